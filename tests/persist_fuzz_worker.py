"""Child process of ``test_persist_untrusted.py::test_header_fuzzing_in_a_child_process_under_a_memory_limit``.

Saves caches of several compositions from a tiny model, then applies hypothesis-drawn edits to
their headers (the tensors stay as written, so their checksums stay valid) and loads each edited
file. The outcome of every edit must be one of:

- a :class:`~kvpolicy.errors.CacheFileError`;
- a cache that continues, step for step, with logits equal bit for bit to the original file's.

Anything else (another exception, different logits, a step over 20 s, memory beyond the cap set
on this process's address space) is written to ``--out`` as a failure.

Each composition is saved as it is and, where a file codec is registered (the research plugin's, when it
is installed: ``codec="entropy"``), coded by each. A coded file's edits also reach its ``coding`` entries
(dtype, shape, symbol width of each coded tensor), and may instead change its coded payloads (bytes
replaced, bits flipped, the payload cut short or lengthened), under a header left as written.

What an edit may be: a value replaced by one of another JSON type (numbers, strings, null, lists,
mappings, deep nesting), a key removed or added, and, outside the ``composition``, a value changed
within its type (integers moved, strings replaced, booleans flipped, list entries dropped or
repeated). Not drawn: a composition value changed within its type (``window=4`` to ``window=8``,
another seed) and a tensor reference renamed to another stored tensor. Those leave the file a
valid description of another cache, which checksums written by the same hand cannot tell from
the original: such a file loads as what it describes, by design.
"""

from __future__ import annotations

import argparse
import json
import resource
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
from conftest import tiny_model
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from kvpolicy import CompressedCache, registry
from kvpolicy.actions.quantize import Quantize
from kvpolicy.actions.tiered import Tiered
from kvpolicy.attention import enable_scores
from kvpolicy.errors import CacheFileError
from kvpolicy.policies.log import LogWindow

try:  # the research plugin's codec, registered explicitly (the tests load no plugin by entry point)
    from kvpolicy_research import formats_plugin

    registry.register(formats_plugin, "research-formats")
except ImportError:
    pass
#: the file codecs every composition is also saved with
CODECS = tuple(registry.names("codecs"))

#: the headroom above this process's address space once everything is imported and built
HEADROOM = 2 << 30
#: seconds one edit may take (load and the decode steps after it)
STEP_SECONDS = 20

PER_TOKEN = {"group_size": 16, "key_axis": "token"}
COMPOSITIONS: dict[str, dict[str, Any]] = {
    "log-minmax": {"policy": "log", "window": 4, "bits": 2, "group_size": 16},
    "codebook-rotated": {"policy": "log", "window": 4, "bits": 2, "scheme": "codebook", "transform": "hadamard"},
    "recent-flush": {"policy": "recent", "window": 8, "variant": "flush", "bits": 4, "group_size": 16},
    "sink-evict": {"policy": "sink", "sinks": 2, "window": 8, "action": "evict"},
    "h2o": {"policy": "h2o", "heavy": 4, "recent": 4, "bits": 2, "group_size": 16},
    "tiered": {
        "policy": "log", "window": 4,
        "action": Tiered(tiers=[Quantize(bits=4, **PER_TOKEN), Quantize(bits=2, group_size=16)], keep=[LogWindow(4)]),
    },
}  # fmt: skip


class StepTimeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise StepTimeout(f"an edit took more than {STEP_SECONDS} s")


def _steps(model: torch.nn.Module, cache: CompressedCache, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(ids.shape[1])], 1)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into ``node`` (keys of mappings, indices of lists), the root included."""
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*prefix, i))
    return out


def _get(node: Any, path: tuple) -> Any:
    for step in path:
        node = node[step]
    return node


def _set(node: Any, path: tuple, value: Any) -> None:
    _get(node, path[:-1])[path[-1]] = value


OTHER_TYPES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 0, 1, 2, 2**31, 2**63]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(["float64", "float16", "channel", "token", "compressed", "transformers", "packed-v1", "t0"]),
    st.none(),
    st.booleans(),
    st.lists(st.integers(-3, 2**33), max_size=5),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.integers(40, 80).map(lambda depth: json.loads("[" * depth + "]" * depth)),
)


def _kind(value: Any) -> str:
    return "bool" if isinstance(value, bool) else type(value).__name__


@st.composite
def edits(draw: Any, header: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """An edited copy of ``header`` and a description of the edit."""
    edited = json.loads(json.dumps(header))
    paths = [p for p in _paths(edited) if p]
    path = draw(st.sampled_from(paths))
    parent, key, value = _get(edited, path[:-1]), path[-1], _get(edited, path)
    in_composition = path[0] == "composition"
    ops = ["retype", "remove", "add"]
    if not in_composition and key != "$tensor" and not isinstance(value, (dict, type(None))):
        ops.append("within")
    op = draw(st.sampled_from(ops))
    if op == "retype":
        new = draw(OTHER_TYPES.filter(lambda v: _kind(v) != _kind(value)))
        _set(edited, path, new)
        return f"{path}: {value!r:.40} -> {new!r:.40}", edited
    if op == "remove":
        if isinstance(parent, dict):
            del parent[key]
        else:
            parent.pop(key)
        return f"{path}: removed", edited
    if op == "add":
        target = value if isinstance(value, (dict, list)) else parent
        extra = draw(OTHER_TYPES)
        if isinstance(target, dict):
            target[draw(st.text(min_size=1, max_size=6).filter(lambda k: k not in target))] = extra
        else:
            target.insert(draw(st.integers(0, len(target))), extra)
        return f"{path}: added {extra!r:.40}", edited
    if isinstance(value, bool):
        new = not value
    elif isinstance(value, int):
        new = draw(st.one_of(st.integers(-2, 2).map(lambda d: value + d), st.sampled_from([0, -1, 2**31, 2**40])))
    elif isinstance(value, float):
        new = draw(st.floats(allow_nan=False, allow_infinity=False))
    elif isinstance(value, str):
        new = draw(st.one_of(st.text(max_size=8), st.sampled_from(["float64", "channel", "token", "codebook-v2"])))
    else:  # a list
        if not value:
            new = [draw(OTHER_TYPES)]
        elif draw(st.booleans()):
            i = draw(st.integers(0, len(value) - 1))
            new = value[:i] + value[i + 1 :]
        else:
            i = draw(st.integers(0, len(value) - 1))
            new = value[: i + 1] + value[i:]
    _set(edited, path, new)
    return f"{path}: {value!r:.40} -> {new!r:.40} (within its type)", edited


@st.composite
def payload_edits(draw: Any, header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> tuple[str, dict]:
    """``tensors`` with one coded payload changed, and a description of the change."""
    name = draw(st.sampled_from(sorted(header["coding"])))
    payload = tensors[name].clone()
    op = draw(st.sampled_from(["byte", "bit", "cut", "extend"]))
    at = draw(st.integers(0, payload.numel() - 1))
    if op == "byte":
        payload[at] = draw(st.integers(0, 255).filter(lambda v: v != payload[at].item()))
    elif op == "bit":
        payload[at] ^= 1 << draw(st.integers(0, 7))
    elif op == "cut":
        payload = payload[:at].clone()
    else:
        payload = torch.cat([payload, torch.randint(0, 256, (draw(st.integers(1, 64)),), dtype=torch.uint8)])
    return f"payload {name}: {op} at {at}", {**tensors, name: payload}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--examples", type=int, default=120)
    parser.add_argument("--seed", type=int, default=None, help="explore other edits (default: a fixed sequence)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = tiny_model("llama")
    enable_scores(model)  # h2o's scores; outputs unchanged
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(5))
    nxt = torch.randint(3, 96, (2, 3), generator=torch.Generator().manual_seed(11))
    work = Path(tempfile.mkdtemp(prefix="kvpolicy-fuzz-"))
    cases = []
    for name, kwargs in COMPOSITIONS.items():
        cache = CompressedCache(backend="torch", **kwargs)
        with torch.no_grad():
            model(ids[:, :30], cache=cache, use_cache=True)
            for t in range(30, 40):
                model(ids[:, t : t + 1], cache=cache, use_cache=True)
        for coded in (None, *CODECS):
            path = work / f"{name}{'.coded' if coded else ''}.kvc"
            cache.save(path, model=model, codec=coded)
            with safe_open(str(path), framework="pt") as f:
                header = json.loads(f.metadata()["kvpolicy"])
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
            label = f"{name}{' (coded)' if coded else ''}"
            cases.append((label, header, tensors, _steps(model, CompressedCache.load(path), nxt)))

    # from here on the address space is capped: a file that makes load or decode reserve more fails
    used = int(Path("/proc/self/status").read_text().split("VmSize:")[1].split()[0]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (used + HEADROOM, used + HEADROOM))
    signal.signal(signal.SIGALRM, _alarm)
    report: dict[str, Any] = {"examples": 0, "refused": 0, "continued": 0, "failures": []}

    @settings(
        max_examples=args.examples, derandomize=args.seed is None, database=None, deadline=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(st.data())
    def one(data: Any) -> None:
        name, header, tensors, reference = data.draw(st.sampled_from(cases))
        if "coding" in header and data.draw(st.booleans()):
            what, tensors = data.draw(payload_edits(header, tensors))
            edited = header
        else:
            what, edited = data.draw(edits(header))
        report["examples"] += 1
        target = work / "edited.kvc"
        try:
            save_file(tensors, str(target), metadata={"kvpolicy": json.dumps(edited)})
        except Exception:  # an edit safetensors itself cannot write is no case
            return
        signal.alarm(STEP_SECONDS)
        try:
            try:
                loaded = CompressedCache.load(target)
            except CacheFileError:
                report["refused"] += 1
                return
            logits = _steps(model, loaded, nxt)
            if not torch.equal(logits, reference):
                report["failures"].append(f"{name}: {what}: loaded, but continues with other logits")
            else:
                report["continued"] += 1
        except BaseException as exc:  # every other outcome is a failure to report
            if isinstance(exc, KeyboardInterrupt):
                raise
            tail = traceback.format_exc().splitlines()[-3:]
            report["failures"].append(f"{name}: {what}: {type(exc).__name__}: {exc!s:.200} | {' | '.join(tail)}")
        finally:
            signal.alarm(0)

    if args.seed is not None:
        one = seed(args.seed)(one)
    one()
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
