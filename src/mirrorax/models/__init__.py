"""Adapters that turn a model into the pure functions the engine jits (see :mod:`mirrorax.models.base`)."""

from mirrorax.models.adapters import adapt as adapt
from mirrorax.models.base import ModelAdapter as ModelAdapter
from mirrorax.models.functional import FunctionalModel as FunctionalModel
