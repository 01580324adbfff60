"""What ``strategy.jit`` returns: ``jax.jit``'s and ``nnx.jit``'s calling conventions over a compiled step.

A :class:`~mirrorax.steps.stateful.StatefulFunction` takes positional arguments, every one of them traced. A
program written for ``@jax.jit`` or ``@nnx.jit`` also passes keyword arguments, marks some arguments static
(``static_argnums`` / ``static_argnames``: Python values the program is specialised on, e.g. a flag or a
sample index count), donates by name (``donate_argnames``) and decorates methods (``@nnx.jit def
generate_step(self, ...)``: ``self``, a Flax NNX module, is bound as the first argument). :class:`JitFunction`
takes the call as written and hands the compiled step the positional form it takes:

* the static arguments are taken out and bound into the function (one compiled step per distinct set of
  static values, as ``jax.jit`` compiles one program per value; they must be hashable, as there);
* keyword arguments that are not static become positional arguments after the positional ones (a call with
  other keywords is another step);
* ``donate_argnums`` / ``donate_argnames`` name the same arguments whether they are passed by position or by
  name (the function's signature relates the two, as ``jax.jit`` relates them).

A call with positional arguments only and no static argument goes straight to the one step (no binding).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["JitFunction", "MakeStep"]

MakeStep = Callable[[Callable[..., Any], tuple[int, ...]], Any]
"""``make(fn, donate_argnums)``: the compiled step of ``fn`` (positional arguments) with those donated."""


def _as_tuple(value: int | str | Sequence[Any] | None, kind: type, name: str) -> tuple[Any, ...]:
    items = () if value is None else (value,) if isinstance(value, (int, str)) else tuple(value)
    bad = [v for v in items if not isinstance(v, kind) or isinstance(v, bool)]
    if bad:
        raise TypeError(f"{name} must be {'an int' if kind is int else 'a str'} or a sequence of them; received "
                        f"{value!r} (holding {bad[0]!r} of type {type(bad[0]).__name__}).")
    return items


class JitFunction:
    """``strategy.jit(fn, ...)``: call it as ``fn`` is called (positional and keyword arguments), or as a
    method (``self`` bound first). See the module's docstring.

    Attributes:
      static_argnums, static_argnames, donate_argnums, donate_argnames: as given, each completed from the
        other through ``fn``'s signature (``jax.jit``'s rule): a parameter named static or donated is so
        whether it is passed by position or by keyword.
    """

    def __init__(self, fn: Callable[..., Any], make: MakeStep, *, donate_argnums: int | Sequence[int] = (),
                 donate_argnames: str | Sequence[str] | None = None, static_argnums: int | Sequence[int] = (),
                 static_argnames: str | Sequence[str] | None = None) -> None:
        self._fn, self._make = fn, make
        try:
            self._signature: inspect.Signature | None = inspect.signature(fn)
        except (TypeError, ValueError):  # (a callable whose signature Python cannot read: positional only)
            self._signature = None
        params = list(self._signature.parameters.values()) if self._signature is not None else []
        positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        keywords = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

        def complete(nums: tuple[int, ...], names: tuple[str, ...], what: str) -> tuple[tuple[int, ...],
                                                                                        tuple[str, ...]]:
            unknown = [n for n in names if n not in keywords and self._signature is not None
                       and not any(p.kind is p.VAR_KEYWORD for p in params)]
            if unknown:
                raise ValueError(f"{what}_argnames names {unknown[0]!r}, which is no parameter of "
                                 f"{getattr(fn, '__name__', 'fn')}{self._signature}. Name one of "
                                 f"{sorted(keywords)}.")
            nums = tuple(sorted({n if n >= 0 else len(positional) + n for n in nums}))
            names_out = set(names) | {positional[n] for n in nums if n < len(positional)}
            nums_out = set(nums) | {positional.index(n) for n in names if n in positional}
            return tuple(sorted(nums_out)), tuple(sorted(names_out))

        self.static_argnums, self.static_argnames = complete(
            _as_tuple(static_argnums, int, "static_argnums"), _as_tuple(static_argnames, str, "static_argnames"),
            "static")
        self.donate_argnums, self.donate_argnames = complete(
            _as_tuple(donate_argnums, int, "donate_argnums"), _as_tuple(donate_argnames, str, "donate_argnames"),
            "donate")
        both: list[Any] = sorted(set(self.static_argnames) & set(self.donate_argnames)) or \
            sorted(set(self.static_argnums) & set(self.donate_argnums))
        if both:
            raise ValueError(f"{getattr(fn, '__name__', 'fn')}: an argument cannot be both static and donated; "
                             f"received {both[0]!r} in both. A static argument is a Python value bound into the "
                             "program, not a buffer.")
        self._static = bool(self.static_argnums or self.static_argnames)
        # The step of a call with positional arguments only (none static): the common case, no binding.
        self._direct = None if self._static else make(fn, self.donate_argnums)
        self._bound: dict[Any, Any] = {}  # (static values, layout of the dynamic arguments) -> its step
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs and self._direct is not None:
            return self._direct(*args)
        step, dynamic = self._resolve(args, kwargs)
        return step(*dynamic)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """As a method: ``self`` bound as the first argument (``nnx.jit``'s and ``jax.jit``'s rule)."""
        return self if obj is None else types.MethodType(self, obj)

    # -- the compiled step's view ----------------------------------------------------------------------------
    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(...).lower`` of the program this call would run."""
        step, dynamic = self._resolve(args, kwargs) if kwargs or self._direct is None else (self._direct, args)
        return step.lower(*dynamic)

    def program(self, *args: Any) -> Any:
        """The compiled program of one signature (:meth:`mirrorax.steps.stateful.StatefulFunction.program`)."""
        step, dynamic = self._resolve(args, {}) if self._direct is None else (self._direct, args)
        return step.program(*dynamic)

    @property
    def compile_count(self) -> int:
        """How many programs were compiled (one per signature, and per set of static values)."""
        steps = ([self._direct] if self._direct is not None else []) + list(self._bound.values())
        return sum(s.compile_count for s in steps)

    # -- binding ------------------------------------------------------------------------------------------
    def _resolve(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
        """The step for this call and its positional arguments: static ones bound in, keyword ones appended."""
        statics_pos = self.static_argnums
        statics_kw = self.static_argnames
        fixed = tuple((i, args[i]) for i in statics_pos if i < len(args))
        fixed_kw = tuple(sorted((k, v) for k, v in kwargs.items() if k in statics_kw))
        dynamic = tuple(a for i, a in enumerate(args) if i not in statics_pos)
        names = tuple(k for k in kwargs if k not in statics_kw)
        key = (len(args), fixed, fixed_kw, names)
        try:
            step = self._bound.get(key)
        except TypeError as e:  # an unhashable static value
            bad = next((f"argument {i}" for i, v in fixed if not _hashable(v)),
                       next((f"argument {k!r}" for k, v in fixed_kw if not _hashable(v)), "a static argument"))
            raise TypeError(f"{getattr(self._fn, '__name__', 'fn')}: static {bad} must be hashable (a static "
                            "argument is part of the compiled program's key, as for jax.jit); received an "
                            f"unhashable value. Pass it as a traced argument, or as a tuple instead of a list.") \
                from e
        if step is None:
            if self._signature is not None:
                self._signature.bind(*args, **kwargs)  # (a call Python would refuse: its own TypeError)
            step = self._bound[key] = self._make(self._bind(len(args), dict(fixed), dict(fixed_kw), names),
                                                 self._donated(len(args), names))
        return step, dynamic + tuple(kwargs[k] for k in names)

    def _bind(self, count: int, fixed: dict[int, Any], fixed_kw: dict[str, Any],
              names: tuple[str, ...]) -> Callable[..., Any]:
        """``fn`` as a function of the dynamic arguments of a call with ``count`` positional arguments (those in
        ``fixed`` static), the static keywords ``fixed_kw`` and the dynamic keywords ``names`` (appended)."""
        fn = self._fn
        slots = [i for i in range(count) if i not in fixed]

        @functools.wraps(fn)
        def bound(*dynamic: Any) -> Any:
            positional = list(range(count))
            for i, a in zip(slots, dynamic):
                positional[i] = a
            for i, v in fixed.items():
                positional[i] = v
            keywords = dict(zip(names, dynamic[len(slots):]))
            keywords.update(fixed_kw)
            return fn(*positional, **keywords)

        return bound

    def _donated(self, count: int, names: tuple[str, ...]) -> tuple[int, ...]:
        """The positions, among a call's dynamic arguments, of those donated."""
        slots = [i for i in range(count) if i not in self.static_argnums]
        out = [j for j, i in enumerate(slots) if i in self.donate_argnums]
        out += [len(slots) + j for j, k in enumerate(names) if k in self.donate_argnames]
        return tuple(out)


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True
