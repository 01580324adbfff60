"""The package's version, on the ground floor: read by ``mirrorax/__init__.py`` and by the checkpoint
metadata (``checkpoint/resume.py``) without importing the package's top."""

__version__ = "0.1.0"
