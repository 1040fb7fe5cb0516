"""KAI Scheduler's GPU-sharing annotations, read as KAI reads them (pure).

KAI Scheduler counts a pod's share of a GPU from annotations, not from a resource, and
enforces none of it on drivers before R615. The forms, as in KAI's source
(`pkg/common/constants`, `pkg/common/resources`):

- `gpu-memory: "2000"`: MiB on each GPU; `gpu-fraction: "0.5"`: a portion of each GPU's
  memory, above 0 and below 1. One or the other.
- `gpu-fraction-num-devices: "2"`: that many GPUs, each with that share.
- `gpu-fraction-container-name`: the container that gets it; the first container else.
- A limit above the request: `gpu-memory.limit: "8Gi"` (a quantity), `gpu-fraction.limit`
  or `kai.scheduler/container.<name>.gpu-memory.portion.limit` (a portion below 1).
- NvFractions: `nvidia.com/container.<name>.gpu-memory.request` and `.limit`, quantities,
  for one container. (`.gpus.devices` there is the binder's, not a declaration.)

A share on N GPUs is declared as N times one, spread over N GPUs (`Declaration.gpus`): it
is held per GPU, one share on each, as KAI placed it, never the sum on one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation

from enforcer.core.declaration import GPUS_DIGITS, PORTION_DIGITS, Declaration, Portion
from enforcer.core.model import MiB
from enforcer.core.parsing import ConfigError, ascii_int, parse_bytes

FRACTION = "gpu-fraction"
MEMORY = "gpu-memory"
FRACTION_LIMIT = "gpu-fraction.limit"
MEMORY_LIMIT = "gpu-memory.limit"
NUM_DEVICES = "gpu-fraction-num-devices"
CONTAINER = "gpu-fraction-container-name"
_PORTION_LIMIT = ("kai.scheduler/container.", ".gpu-memory.portion.limit")
_NV_REQUEST = ("nvidia.com/container.", ".gpu-memory.request")
_NV_LIMIT = ("nvidia.com/container.", ".gpu-memory.limit")
_MAX_DECIMALS = 5  # KAI refuses portion limits with more digits after the point


def declares(annotations: Mapping[str, object]) -> bool:
    """Whether the pod declares a GPU share in any of KAI's forms."""
    return any(
        key in (FRACTION, MEMORY)
        or _container_of(key, _NV_REQUEST)
        or _container_of(key, _NV_LIMIT)
        for key in annotations
    )


def nv_fractions(annotations: Mapping[str, object]) -> bool:
    """Whether the pod declares its share in the NvFractions form, the one gpu-fractioning
    serves."""
    return any(_container_of(k, _NV_REQUEST) or _container_of(k, _NV_LIMIT) for k in annotations)


# Checks a limit above the request: (ceiling in bytes, or None for a portion of a GPU;
# the request in bytes; the annotation's key; its value). Raises ConfigError to refuse it.
Borrowing = Callable[[int | None, int, str, object], None]


def declaration(
    annotations: Mapping[str, object],
    containers: Sequence[str],
    init_containers: Sequence[str],
    borrowing: Borrowing,
) -> Declaration:
    """What KAI's annotations declare, for the pod whose regular and init containers are
    named; an empty Declaration when they declare nothing. Raises ConfigError, naming the
    annotation, for what KAI itself would refuse, and for a limit `borrowing` refuses."""
    nv = _nv_fractions(annotations, (*containers, *init_containers))
    fraction = _text(annotations, FRACTION)
    memory = _text(annotations, MEMORY)
    if fraction is not None and memory is not None:
        raise _error(
            MEMORY, memory, f"is set beside {FRACTION}; KAI takes one or the other: remove one"
        )
    if nv is not None and fraction is not None:
        raise _error(
            FRACTION,
            fraction,
            "is set beside NvFractions annotations "
            f"({nv[0]!r}); KAI takes one or the other: remove one",
        )
    count = _devices(annotations, fraction is not None or memory is not None)
    for key in (FRACTION_LIMIT, MEMORY_LIMIT):
        base = FRACTION if key == FRACTION_LIMIT else MEMORY
        if key in annotations and annotations.get(base) is None:
            raise _error(key, annotations[key], f"is set without {base}; use it beside {base}")
    if nv is not None:
        if MEMORY_LIMIT in annotations:
            nv_limit = f"{_NV_LIMIT[0]}{nv[0]}{_NV_LIMIT[1]}"
            raise _error(
                MEMORY_LIMIT,
                annotations[MEMORY_LIMIT],
                f"is set beside NvFractions annotations; give the limit as {nv_limit}",
            )
        return _from_nv(nv, memory, annotations, borrowing)
    if fraction is None and memory is None:
        return Declaration()
    target = _target(annotations, containers, init_containers)
    gpus = {target: count} if count > 1 else {}  # one share held on each of them
    if memory is not None:
        each = _mib(memory)
        request, ceiling = each * count, _memory_limit(annotations, each) * count
        if ceiling == request:
            return Declaration({target: request}, gpus=gpus)
        borrowing(ceiling, request, MEMORY_LIMIT, annotations[MEMORY_LIMIT])
        return Declaration({target: request}, {target: ceiling}, gpus=gpus)
    assert fraction is not None  # noqa: S101 - one of the two is set
    share = _fraction(fraction, FRACTION)
    limit = _fraction_limit(annotations, target, share, borrowing)
    return Declaration(
        portions={target: Portion(share * count, None if limit is None else limit * count)},
        gpus=gpus,
    )


def _target(
    annotations: Mapping[str, object], containers: Sequence[str], init_containers: Sequence[str]
) -> str:
    named = _text(annotations, CONTAINER)
    if named is None:
        if not containers:
            key = FRACTION if FRACTION in annotations else MEMORY
            raise _error(key, annotations[key], "is set on a pod with no containers")
        return containers[0]
    if named not in (*containers, *init_containers):
        raise _error(CONTAINER, named, f"names no container of the pod ({', '.join(containers)})")
    return named


def _devices(annotations: Mapping[str, object], share: bool) -> int:
    text = _text(annotations, NUM_DEVICES)
    if text is None:
        return 1
    if not share:
        raise _error(NUM_DEVICES, text, f"is set without {FRACTION} or {MEMORY}; use it beside one")
    count = ascii_int(text, GPUS_DIGITS)
    if not count:
        raise _error(NUM_DEVICES, text, "is not a whole number of GPUs above 0")
    return count


def _mib(text: str) -> int:
    mib = ascii_int(text, 12)
    if not mib:
        raise _error(MEMORY, text, 'is not a whole number of MiB above 0, e.g. "2000"')
    return mib * MiB


def _memory_limit(annotations: Mapping[str, object], request: int) -> int:
    text = _text(annotations, MEMORY_LIMIT)
    if text is None:
        return request
    if text.isdigit():
        raise _error(MEMORY_LIMIT, text, 'has no unit; KAI takes a quantity with one, e.g. "8Gi"')
    limit = _quantity(MEMORY_LIMIT, text)
    if limit < request:
        raise _error(
            MEMORY_LIMIT,
            text,
            f"is below {MEMORY} ({request // MiB} MiB); a limit is at least the request",
        )
    return limit


def _fraction_limit(
    annotations: Mapping[str, object], target: str, share: Decimal, borrowing: Borrowing
) -> Decimal | None:
    per_container = {
        name: (key, value)
        for key, value in annotations.items()
        if (name := _container_of(key, _PORTION_LIMIT))
    }
    given = [(FRACTION_LIMIT, annotations[FRACTION_LIMIT])] if FRACTION_LIMIT in annotations else []
    for name, (key, value) in per_container.items():
        if name != target:
            raise _error(
                key,
                value,
                f"names container {name!r}, but {FRACTION} is for {target!r}; name that container",
            )
        given.append((key, value))
    if len(given) > 1:
        raise _error(given[1][0], given[1][1], f"is set beside {given[0][0]}; use one")
    if not given:
        return None
    key, value = given[0]
    limit = _fraction(str(value), key)
    _, _, decimals = str(value).partition(".")
    if len(decimals) > _MAX_DECIMALS:
        raise _error(key, value, f"has more than {_MAX_DECIMALS} digits after the point")
    if limit <= share:
        raise _error(key, value, f"is not above {FRACTION} ({share}); a limit is above the request")
    borrowing(None, 0, key, value)
    return limit


def _nv_fractions(
    annotations: Mapping[str, object], names: Sequence[str]
) -> tuple[str, int, int | None] | None:
    """(container, request, limit) of the NvFractions form; None when it is not used."""
    requests = {n: (k, v) for k, v in annotations.items() if (n := _container_of(k, _NV_REQUEST))}
    limits = {n: (k, v) for k, v in annotations.items() if (n := _container_of(k, _NV_LIMIT))}
    if not requests and not limits:
        return None
    every = {**requests, **limits}
    if len(every) > 1:
        key, value = every[sorted(every)[1]]
        raise _error(
            key, value, "names a second container; KAI gives a GPU share to one container per pod"
        )
    (name,) = every
    if name not in names:
        key, value = every[name]
        raise _error(key, value, f"names container {name!r}, which the pod does not have")
    if name not in requests:
        key, value = limits[name]
        raise _error(
            key,
            value,
            f"is set without {_NV_REQUEST[0]}{name}{_NV_REQUEST[1]}; a limit needs a request",
        )
    request = _quantity(*requests[name])
    if request == 0:
        raise _error(*requests[name], "is 0; a request is above 0")
    limit = _quantity(*limits[name]) if name in limits else None
    if limit is not None and limit < request:
        raise _error(*limits[name], "is below the container's request; a limit is at least it")
    return name, request, limit


def _from_nv(
    nv: tuple[str, int, int | None],
    memory: str | None,
    annotations: Mapping[str, object],
    borrowing: Borrowing,
) -> Declaration:
    name, request, limit = nv
    if memory is not None and _mib(memory) != request:
        raise _error(
            MEMORY,
            memory,
            f"differs from the NvFractions request of container {name!r}; KAI needs them equal",
        )
    if limit is None or limit == request:
        return Declaration({name: request})
    key = f"{_NV_LIMIT[0]}{name}{_NV_LIMIT[1]}"
    borrowing(limit, request, key, annotations[key])
    return Declaration({name: request}, {name: limit})


def _container_of(key: str, form: tuple[str, str]) -> str:
    prefix, suffix = form
    if key.startswith(prefix) and key.endswith(suffix) and len(key) > len(prefix) + len(suffix):
        return key[len(prefix) : -len(suffix)]
    return ""


def _fraction(text: str, key: str) -> Decimal:
    try:
        value = Decimal(text.strip())
    except InvalidOperation:
        value = Decimal("NaN")
    if not value.is_finite() or not 0 < value < 1:
        raise _error(key, text, 'is not a portion of a GPU above 0 and below 1, e.g. "0.5"')
    exponent = value.as_tuple().exponent
    if isinstance(exponent, int) and -exponent > PORTION_DIGITS:
        raise _error(
            key,
            text,
            f"has more than {PORTION_DIGITS} digits after the point; "
            f"give a portion above 0 and below 1 with at most {PORTION_DIGITS}, "
            'e.g. "0.5"',
        )
    return value


def _quantity(key: str, value: object) -> int:
    return parse_bytes(str(value), f"metadata.annotations[{key!r}]")


def _text(annotations: Mapping[str, object], key: str) -> str | None:
    value = annotations.get(key)
    return None if value is None else str(value)


def _error(key: str, value: object, problem: str) -> ConfigError:
    return ConfigError(f"metadata.annotations[{key!r}]", value, problem)
