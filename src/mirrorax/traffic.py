"""``mx.traffic`` (this module: ``mirrorax.traffic``): what a compiled program's collectives send, within a
host and across hosts.

Each collective of the compiled program's HLO text is read with its device groups, in the three forms XLA
prints them (``replica_groups={{0,1,2,3},{4,5,6,7}}``; the iota form ``[2,4]<=[4,2]T(1,0)``; the mesh form
``mesh['a'=2,'b'=4] {'b'}``) and in the id space the collective's attributes give them (XLA's group
modes: replica ids without ``channel_id``, partition ids for ``collective-permute`` and ``all-to-all``
with one, global ids ``replica * num_partitions + partition`` with ``use_global_device_ids=true``, and
the replicas' every partition without it). Ids become devices through the program's device assignment
(for ``jax.jit`` with ``NamedSharding``: the mesh's devices in row-major order).

What each device sends is the bandwidth-optimal ring's volume, sent to its successor in the group's
order (the ring XLA:CPU's gloo and NCCL's ring algorithm run, in rank order): an all-reduce of ``S``
bytes sends ``2 (n-1)/n S`` per member, an all-gather ``(n-1)/n`` of its result, a reduce-scatter
``(n-1)/n`` of its operand (``n - 1`` results), an all-to-all ``S/n`` to each other member, a
collective-permute its whole operand to its target. A send crosses hosts when its receiver is on
another host, so a ring over a group that spans ``h`` hosts, listed host by host, crosses ``h`` times.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["Collective", "Traffic", "traffic", "traffic_of", "collective_bytes", "host_map"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# A collective: its result (one array type, or a tuple of them, which may hold /*index=N*/ comments), its
# kind, and the rest of its line (operands and attributes).
_COLLECTIVE = re.compile(r"=\s*(\([^)]*\)|[a-z0-9]+\[[0-9,]*\][^ ]*)\s+"
                         r"(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\((.*)$",
                         re.MULTILINE)
_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_BITS = {"pred": 8, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32, "u32": 32,
         "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128}
_LISTS = re.compile(r"replica_groups=(\{(?:\{[0-9,]*\},?)*\})")
_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                   r"(?:, device_ids=\((\[[0-9,]+\](?:T\([0-9,]+\))?|[^)]*)\))? \{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9]+,[0-9]+\},?)*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program and what it sends per run of the program.

    Attributes:
      kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``, ``"all-to-all"`` or
        ``"collective-permute"``.
      result_bytes: the bytes of its result on one device.
      groups: the devices (``jax.Device.id``) of each group, in the group's order; for a
        collective-permute, its ``(source, target)`` pairs.
      within_bytes, across_bytes: bytes its devices send, summed over them, to a device of the same host /
        of another host (the ring model of :mod:`mirrorax.traffic`).
    """

    kind: str
    result_bytes: int
    groups: tuple[tuple[int, ...], ...]
    within_bytes: float
    across_bytes: float


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What a program's collectives send per run: within a host and across hosts.

    Attributes:
      hosts: the host of each device of the program (``jax.Device.id`` -> host).
      collectives: each collective of the program, in program order.
      per_device: ``{device id: (bytes sent within its host, bytes sent across hosts)}``.
    """

    hosts: dict[int, Hashable]
    collectives: tuple[Collective, ...]
    per_device: dict[int, tuple[float, float]]

    @property
    def num_hosts(self) -> int:
        """How many hosts the program's devices are on."""
        return len(set(self.hosts.values()))

    @property
    def within_bytes(self) -> int:
        """Bytes sent per run to a device of the same host, all devices together."""
        return round(sum(c.within_bytes for c in self.collectives))

    @property
    def across_bytes(self) -> int:
        """Bytes sent per run to a device of another host, all devices together."""
        return round(sum(c.across_bytes for c in self.collectives))

    @property
    def max_across_bytes(self) -> int:
        """The most bytes one device sends across hosts per run (the busiest link's share)."""
        return round(max((a for _, a in self.per_device.values()), default=0.0))


def _result_bytes(result: str, kind: str, start: bool) -> int:
    arrays = [(dtype, dims) for dtype, dims in _SHAPE.findall(result) if dtype in _BITS]
    if start and kind in ("all-gather", "collective-permute"):
        # An async start returns (operands, results[, u32 contexts]): count the results only.
        arrays = [a for a in arrays if a[1] != ""]
        arrays = arrays[len(arrays) // 2:]
    return sum(math.prod(int(d) for d in dims.split(",") if d) * _BITS[dtype] // 8 for dtype, dims in arrays)


def collective_bytes(hlo: str) -> int:
    """The result bytes of every collective in an HLO module's text, on one device."""
    return sum(_result_bytes(m.group(1), m.group(2), bool(m.group(3))) for m in _COLLECTIVE.finditer(hlo))


def _ints(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"[0-9]+", text)]


def _iota(dims: Sequence[int], reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    """XLA's iota tile assignment ``[dims]<=[reshape]T(perm)``: iota, reshaped, transposed, reshaped."""
    a = np.arange(math.prod(reshape)).reshape(reshape)
    return (a.transpose(perm) if perm else a).reshape(dims)


def _mesh_groups(axes_text: str, ids_text: str | None, grouped_text: str) -> list[list[int]]:
    """The groups of XLA's mesh form: the mesh's ids varying along the grouped (sub-)axes, the others fixed."""
    named = re.findall(r"'?([^'=,]+)'?=([0-9]+)", axes_text)
    names, sizes = [n for n, _ in named], [int(s) for _, s in named]
    if ids_text is None:
        ids = np.arange(math.prod(sizes)).reshape(sizes)
    else:
        m = re.fullmatch(r"\s*\[([0-9,]+)\](?:T\(([0-9,]+)\))?\s*", ids_text)
        # the iota form ([4,2]T(1,0)), else the ids themselves (a permutation of 0..n-1: never iota's dims)
        iota = m is not None and math.prod(_ints(m.group(1))) == math.prod(sizes)
        ids = (_iota(sizes, _ints(m.group(1)), _ints(m.group(2)) if m.group(2) else None) if m and iota
               else np.asarray(_ints(ids_text)[-math.prod(sizes):]).reshape(sizes))  # after any [dims]
    refs = [(names.index(n), int(pre) if pre else None, int(size) if size else None)
            for n, pre, size in re.findall(r"'?([^':,\s]+)'?(?::\(([0-9]+)\)([0-9]+))?", grouped_text)]
    # Split each mesh axis into the factors its sub-axes name (major to minor), as XLA's
    # MeshAxesReplicaGroupList does, then move the grouped factors last, in the order listed.
    factors: list[int] = []
    where: dict[tuple[int, int | None], int] = {}
    for axis, size in enumerate(sizes):
        subs = sorted({(pre, sz) for a, pre, sz in refs if a == axis and pre is not None and sz is not None})
        done = 1
        for pre, sz in subs:
            if pre != done:
                factors.append(pre // done)
                done = pre
            where[(axis, pre)] = len(factors)
            factors.append(sz)
            done *= sz
        if not subs:
            where[(axis, None)] = len(factors)
            factors.append(size)
        elif done != size:
            factors.append(size // done)
    grouped = [where[(a, pre)] for a, pre, _ in refs]
    order = [i for i in range(len(factors)) if i not in grouped] + grouped
    per_group = math.prod(factors[i] for i in grouped)
    return ids.reshape(factors).transpose(order).reshape(-1, per_group).tolist()


def _groups(attrs: str) -> list[list[int]] | None:
    """A collective's groups as printed (ids in its mode's id space); ``[]`` for ``{}`` (everyone)."""
    if m := _LISTS.search(attrs):
        return [_ints(g) for g in re.findall(r"\{([0-9,]*)\}", m.group(1)[1:-1])]
    if m := _IOTA.search(attrs):
        dims = _ints(m.group(1))
        return _iota(dims, _ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None).reshape(dims[0], -1).tolist()
    if m := _MESH.search(attrs):
        return _mesh_groups(m.group(1), m.group(2), m.group(3))
    return None


def _participants(kind: str, attrs: str, replicas: int, partitions: int) -> list[list[int]]:
    """The groups (or permute pairs) in global ids ``replica * partitions + partition``, per XLA's group
    mode: replica ids without a ``channel_id``; with one, partition ids (collective-permute, all-to-all),
    global ids (``use_global_device_ids=true``) or replica ids spanning every partition."""
    channel = "channel_id=" in attrs
    if kind == "collective-permute":
        m = _PAIRS.search(attrs)
        if m is None:
            raise ValueError(f"A collective-permute without readable source_target_pairs: {attrs[:300]!r}")
        pairs = [_ints(p) for p in re.findall(r"\{([0-9]+,[0-9]+)\}", m.group(1))]
        if channel:
            return [[r * partitions + s, r * partitions + t] for r in range(replicas) for s, t in pairs]
        return [[s * partitions + p, t * partitions + p] for p in range(partitions) for s, t in pairs]
    groups = _groups(attrs)
    if groups is None:
        raise ValueError(f"Cannot read the device groups of a {kind} (expected replica_groups={{{{...}}}}, the "
                         f"iota form [g,n]<=[...] or the mesh form mesh[...] {{...}}); received: {attrs[:300]!r}. "
                         "Please report it with your jax version.")
    if "use_global_device_ids=true" in attrs:
        return groups or [list(range(replicas * partitions))]
    if not channel:  # cross-replica: the same replicas of each partition
        return [[r * partitions + p for r in g] for p in range(partitions) for g in (groups or [list(range(replicas))])]
    if kind == "all-to-all":  # cross-partition
        return [[r * partitions + p for p in g] for r in range(replicas) for g in (groups or [list(range(partitions))])]
    # cross-replica-and-partition: the listed replicas, each with all its partitions
    return [[r * partitions + p for r in g for p in range(partitions)] for g in (groups or [list(range(replicas))])]


def _sends(kind: str, size: int, group: Sequence[int]) -> list[tuple[int, int, float]]:
    """``(sender, receiver, bytes)`` of one group under the ring model (module docstring)."""
    n = len(group)
    if kind == "collective-permute":
        return [(group[0], group[1], float(size))] if group[0] != group[1] else []
    if n < 2:
        return []
    if kind == "all-to-all":
        return [(a, b, size / n) for a in group for b in group if a != b]
    per_member = {"all-reduce": 2 * (n - 1) / n * size, "all-gather": (n - 1) / n * size,
                  "reduce-scatter": float((n - 1) * size)}[kind]
    return [(group[i], group[(i + 1) % n], per_member) for i in range(n)]


def host_map(devices: Sequence[Any], hosts: Any = None) -> dict[int, Hashable]:
    """The host of each device (``jax.Device.id`` -> host), from ``hosts``:

    * ``None``: each device's ``process_index`` (one process per host, as ``mirrorax launch`` starts them);
    * an int ``k``: ``devices`` in order, cut into ``k`` equal consecutive blocks (``hosts=2`` reads 8
      simulated devices as 2 hosts of 4);
    * a mapping ``{device id: host}``, or a function ``device -> host``.
    """
    if hosts is None:
        return {d.id: d.process_index for d in devices}
    if isinstance(hosts, (int, np.integer)) and not isinstance(hosts, bool):
        if hosts < 1 or len(devices) % hosts:
            raise ValueError(f"hosts={hosts} must divide the program's {len(devices)} devices into equal "
                             "blocks; pass a divisor of the device count, or a {device id: host} mapping.")
        per = len(devices) // int(hosts)
        return {d.id: i // per for i, d in enumerate(devices)}
    if isinstance(hosts, Mapping):
        missing = [d.id for d in devices if d.id not in hosts]
        if missing:
            raise ValueError(f"The hosts mapping has no host for device ids {missing}; it must map every device "
                             f"id of the program ({[d.id for d in devices]}) to its host.")
        return {d.id: hosts[d.id] for d in devices}
    if callable(hosts):
        return {d.id: hosts(d) for d in devices}
    raise TypeError(f"Expected hosts=None, an int, a {{device id: host}} mapping or a function device -> host. "
                    f"Received: {hosts!r} (of type {type(hosts).__name__})")


def traffic_of(hlo: str, devices: Sequence[Any], hosts: Any = None) -> Traffic:
    """The :class:`Traffic` of a compiled HLO module's text whose device assignment is ``devices``
    (replica-major: ``devices[r * num_partitions + p]`` runs replica ``r``, partition ``p``)."""
    header = hlo.split("\n", 1)[0]
    replicas = int(m.group(1)) if (m := re.search(r"replica_count=([0-9]+)", header)) else 1
    partitions = int(m.group(1)) if (m := re.search(r"num_partitions=([0-9]+)", header)) else 1
    if replicas * partitions != len(devices):
        raise ValueError(f"The program runs on {replicas} replica(s) x {partitions} partition(s), but "
                         f"{len(devices)} devices were given: pass the program's own devices, in its order.")
    where = host_map(devices, hosts)
    ids = [d.id for d in devices]
    sent = {i: [0.0, 0.0] for i in ids}
    found = []
    for m in _COLLECTIVE.finditer(hlo):
        kind, attrs = m.group(2), m.group(4)
        size = _result_bytes(m.group(1), kind, bool(m.group(3)))
        groups = [[ids[i] for i in g] for g in _participants(kind, attrs, replicas, partitions)]
        within = across = 0.0
        for a, b, nbytes in (s for g in groups for s in _sends(kind, size, g)):
            crosses = where[a] != where[b]
            sent[a][crosses] += nbytes
            if crosses:
                across += nbytes
            else:
                within += nbytes
        found.append(Collective(kind, size, tuple(tuple(g) for g in groups), within, across))
    return Traffic(where, tuple(found), {i: (w, a) for i, (w, a) in sent.items()})


def _program_devices(compiled: Any) -> list[Any]:
    for s in jax.tree.leaves([compiled.input_shardings, compiled.output_shardings]):
        mesh = getattr(s, "mesh", None)
        if mesh is not None and hasattr(mesh, "devices") and not isinstance(mesh.devices, tuple):
            return list(np.asarray(mesh.devices).flat)
    kinds = sorted({type(s).__name__ for s in jax.tree.leaves([compiled.input_shardings,
                                                                compiled.output_shardings])})
    raise ValueError(f"Cannot tell the compiled program's device order: none of its inputs or outputs has a "
                     f"NamedSharding (received shardings of kinds {kinds}). Pass devices=[...] (its devices, "
                     "in the order of its device assignment).")


def traffic(compiled: Any, *, hosts: Any = None, devices: Sequence[Any] | None = None) -> Traffic:
    """What a compiled JAX program's collectives send per run, within a host and across hosts.

    Args:
      compiled: ``jax.jit(f).lower(...).compile()`` (or ``strategy.jit``'s, a ``jax.stages.Compiled``).
      hosts: which host each device is on: ``None`` (each device's ``process_index``), an int ``k`` (the
        program's devices cut into ``k`` equal consecutive blocks: simulated hosts), a
        ``{device id: host}`` mapping or a function ``device -> host``.
      devices: the program's devices in its device assignment's order; default: the mesh of its first
        ``NamedSharding`` argument or result, row-major (what ``jax.jit`` assigns).

    Returns:
      A :class:`Traffic`: each collective with its groups, and the bytes sent within and across hosts.

    Example:
      >>> mesh = jax.make_mesh((2, 4), ("hosts", "chips"))
      >>> t = mx.traffic(jax.jit(f).lower(x).compile(), hosts=2)   # 2 simulated hosts of 4 devices
      >>> t.across_bytes, t.within_bytes
    """
    devices = list(devices) if devices is not None else _program_devices(compiled)
    return traffic_of(compiled.as_text(), devices, hosts)
