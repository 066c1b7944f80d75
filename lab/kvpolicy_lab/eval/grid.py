"""The ablation grid: models × caches × context lengths × tasks, from a config file or flags.

Config files are TOML (read with the standard library's ``tomllib``) or JSON, with
the same keys::

    models = ["smollm2"]            # or gemma3-270m, tiny-llama, a local path, a hub id in the local HF cache
    dtype = "float32"               # float32 | float16 | bfloat16
    device = "cpu"
    contexts = [2048]
    seed = 0
    replay = true                   # replay the uncompressed prefill (see kvpolicy_lab.eval.measure)
    attention_error = true          # measure attn_error (a shadow attention per step); false, or the contexts
    batch = 1                       # teacher-forced samples decoded together (see kvpolicy_lab.eval.measure)
    decode = "fused"                # or "materialized": how decode steps attend (see kvpolicy_lab.eval.cells)
    equal_bytes = "log/quantize/2b" # anchor label, true (first compressing cache) or false

    [tasks.lm]                      # task name -> its parameters (kvpolicy_lab.eval.tasks); "speed" times
    tokens = 48

    [only]                          # task -> the cache labels that run it (default: every cache)
    lm = ["uncompressed", "log/quantize/2b"]

    [model_caches]                  # model -> the cache labels that run on it (default: every cache)
    gemma3-270m = ["uncompressed", "log/quantize/2b"]

    [model_contexts]                # model -> the contexts it runs at, every task (default: all)
    gemma3-270m = [2048]

    [context_caches]                # context -> the cache labels that run at it (default: every cache)
    8192 = ["uncompressed", "log/quantize/2b"]

    [[caches]]                      # explicit caches (kinds: compressed, preset, dynamic, hf-quantized)
    kind = "hf-quantized"
    backend = "quanto"
    nbits = 2

    [cross]                         # and/or a cross product of registered names
    policies = ["log", "recent:variant=flush", "sink", "h2o"]
    actions = ["quantize", "evict"]
    bits = [2, 4]
    backends = ["torch"]

Names are checked against the registry (plugins included) before any work starts. List-valued keys
(``models``, ``contexts``, the ``[cross]`` lists, the ``[only]``, ``[model_caches]``,
``[model_contexts]`` and ``[context_caches]`` lists, ``size_params``) must be lists: a plain string
such as ``bits = "2,4"`` or ``policies = "log"`` is refused with the list to write instead (``bits =
[2, 4]``), never split into characters.
Task parameters are the exception that the command line needs: ``depths = "0.1,0.5"`` or speed's
``contexts = "512,1024"`` are split at commas.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpolicy.errors import ConfigError
from kvpolicy.spec import parameter_names
from kvpolicy_lab.eval.caches import CacheSpec
from kvpolicy_lab.eval.tasks import TASKS, Task, make_task, parse_number

DTYPES = ("float32", "float16", "bfloat16")
#: the shortest context length a grid runs at
MIN_CONTEXT = 8
#: the timing pseudo-task: real prefill + ``steps`` decode steps on the LM text
SPEED = "speed"
_TOP_KEYS = {"models", "dtype", "device", "contexts", "seed", "replay", "decode", "equal_bytes", "online", "tasks",
             "caches", "cross", "attention", "only", "model_caches", "model_contexts", "context_caches",
             "attention_error", "batch"}  # fmt: skip
#: how a grid's decode steps attend over compressed caches (``decode``; kvpolicy_lab.eval.cells)
DECODE_MODES = ("fused", "materialized")
_CROSS_KEYS = {"policies", "actions", "bits", "backends", "params"}
_ATTENTION_KEYS = ("context", "queries", "top_k", "window")
_SPEED_KEYS = ("contexts", "repeats", "steps")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _suggest(text: str, item: type) -> str:
    """The TOML list a user meant by the string ``text`` (``"2,4"`` -> ``[2, 4]``)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if item is int:
        try:
            return json.dumps([int(p) for p in parts])
        except ValueError:
            return "[2, 4]"
    return json.dumps(parts or ["name"])


def require_list(key: str, value: Any, item: type, what: str) -> list[Any]:
    """``value`` as a list whose elements are all of type ``item``.

    Parameters
    ----------
    key : str
        The config key, as the message shows it (``"contexts"``, ``"[cross] bits"``).
    value : Any
        The value read from the config file or built from flags.
    item : type
        ``str`` or ``int`` (``bool`` is not an ``int`` here).
    what : str
        The elements in words, for the message (``"integers"``).

    Returns
    -------
    list
        ``value`` as a new list.

    Raises
    ------
    ConfigError
        ``value`` is a string (never split into characters; the message shows the list to write),
        not a list, or has an element of another type.
    """
    name = key.rsplit(" ", 1)[-1]
    if isinstance(value, str):
        raise ConfigError(
            f"{key} must be a list of {what}, e.g. {name} = {_suggest(value, item)}; got the string {value!r}"
        )

    def ok(v: Any) -> bool:
        return _is_int(v) if item is int else isinstance(v, item)

    if not isinstance(value, (list, tuple)) or not all(ok(v) for v in value):
        raise ConfigError(f"{key} must be a list of {what}; got {name}={value!r}")
    return list(value)


def require_table(key: str, value: Any) -> dict[str, Any]:
    """``value`` if it is a dict (a TOML table, a JSON object); else a :class:`ConfigError` naming ``key``."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a table (key = value pairs, e.g. [{key}]); got {key}={value!r}")
    return value


def parse_value(text: str) -> Any:
    """``"12"`` -> 12, ``"0.5"`` -> 0.5, ``"true"`` -> True, anything else stays a string."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    return parse_number(text)


def parse_named(spec: str) -> tuple[str, dict[str, Any]]:
    """``"recent:variant=flush:window=128"`` -> ``("recent", {"variant": "flush", "window": 128})``."""
    name, *parts = spec.split(":")
    params = {}
    for part in parts:
        if "=" not in part:
            raise ConfigError(f"expected key=value after ':' in {spec!r}; got {part!r}")
        k, v = part.split("=", 1)
        params[k.strip()] = parse_value(v.strip())
    return name.strip(), params


@dataclass
class Grid:
    """A validated ablation grid (see the module docstring for the keys)."""

    models: list[str] = field(default_factory=lambda: ["smollm2"])
    dtype: str = "float32"
    device: str = "cpu"
    contexts: list[int] = field(default_factory=lambda: [2048])
    seed: int = 0
    replay: bool = True
    decode: str = "fused"
    equal_bytes: str | bool = False
    online: bool = False
    tasks: dict[str, dict[str, Any]] = field(default_factory=lambda: {"lm": {}})
    caches: list[CacheSpec] = field(default_factory=list)
    attention: dict[str, Any] = field(default_factory=dict)
    only: dict[str, list[str]] = field(default_factory=dict)
    model_caches: dict[str, list[str]] = field(default_factory=dict)
    model_contexts: dict[str, list[int]] = field(default_factory=dict)
    context_caches: dict[str, list[str]] = field(default_factory=dict)
    attention_error: bool | list[int] = True
    batch: int = 1

    def __post_init__(self) -> None:
        self._check_types()
        if not self.models or not all(self.models):
            raise ConfigError(f"models must be a non-empty list of names or paths; got models={self.models!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {list(DTYPES)}; got dtype={self.dtype!r}")
        if not self.contexts or any(c < MIN_CONTEXT for c in self.contexts):
            raise ConfigError(
                f"contexts must be a non-empty list of integers >= {MIN_CONTEXT}; got contexts={self.contexts!r}"
            )
        if not self.tasks:
            raise ConfigError(f"tasks must name at least one task; known: {sorted([*TASKS, SPEED])}")
        if not self.caches:
            raise ConfigError("the grid has no caches: give [[caches]] entries or a [cross] product")
        labels = [c.label for c in self.caches]
        dupes = sorted({x for x in labels if labels.count(x) > 1})
        if dupes:
            raise ConfigError(f"cache labels must be unique; repeated: {dupes} (set label = ... to tell them apart)")
        self.task_objects()  # validates names and parameters
        for spec in self.caches:
            spec.validate()
        for task, names in self.only.items():
            if task not in self.tasks:
                raise ConfigError(f"only: {task!r} is not a task of the grid; tasks: {sorted(self.tasks)}")
            missing = sorted(set(names) - {c.label for c in self.caches})
            if missing:
                raise ConfigError(f"only.{task}: unknown cache label(s) {missing}; labels: {labels}")
        for model, names in self.model_caches.items():
            if model not in self.models:
                raise ConfigError(f"model_caches: {model!r} is not a model of the grid; models: {self.models}")
            missing = sorted(set(names) - set(labels))
            if missing:
                raise ConfigError(f"model_caches.{model}: unknown cache label(s) {missing}; labels: {labels}")
        known = sorted({*self.contexts, *(c for t in self.task_objects().values() if isinstance(t, dict)
                                          for c in t["contexts"])})  # fmt: skip
        for model, contexts in self.model_contexts.items():
            if model not in self.models:
                raise ConfigError(f"model_contexts: {model!r} is not a model of the grid; models: {self.models}")
            missing = sorted(set(contexts) - set(known))
            if missing:
                raise ConfigError(f"model_contexts.{model}: context(s) {missing} are not contexts of the grid: {known}")
        if isinstance(self.attention_error, list) and not set(self.attention_error) <= set(self.contexts):
            raise ConfigError(
                f"attention_error: context(s) {sorted(set(self.attention_error) - set(self.contexts))} are not in "
                f"the grid's contexts {self.contexts}; give true, false or a list of those contexts"
            )
        for context, names in self.context_caches.items():
            if not context.isdigit() or int(context) not in known:
                raise ConfigError(f"context_caches: {context!r} is not a context of the grid: {known}")
            missing = sorted(set(names) - set(labels))
            if missing:
                raise ConfigError(f"context_caches.{context}: unknown cache label(s) {missing}; labels: {labels}")

    def _check_types(self) -> None:
        """Every key has the type of its field (config files can hold anything)."""
        from kvpolicy_lab.devices import parse_device

        self.models = require_list("models", self.models, str, "model names or paths")
        self.contexts = require_list("contexts", self.contexts, int, "integers")
        if not _is_int(self.seed) or self.seed < 0:
            raise ConfigError(f"seed must be an integer >= 0; got seed={self.seed!r}")
        if not _is_int(self.batch) or self.batch < 1:
            raise ConfigError(
                f"batch must be an integer >= 1 (teacher-forced samples per forward); got batch={self.batch!r}"
            )
        for key in ("replay", "online"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} must be true or false; got {key}={getattr(self, key)!r}")
        if not isinstance(self.attention_error, bool):
            self.attention_error = require_list("attention_error", self.attention_error, int, "contexts (integers)")
        if self.decode not in DECODE_MODES:
            raise ConfigError(f"decode must be one of {list(DECODE_MODES)}; got decode={self.decode!r}")
        if not isinstance(self.equal_bytes, (str, bool)):
            raise ConfigError(f"equal_bytes must be a cache label, true or false; got equal_bytes={self.equal_bytes!r}")
        if not isinstance(self.device, str):
            raise ConfigError(f"device must be a string such as 'cpu' or 'cuda'; got device={self.device!r}")
        try:
            parse_device(self.device)
        except ConfigError as exc:
            raise ConfigError(f"device: {exc}") from None
        for name, params in require_table("tasks", self.tasks).items():
            require_table(f"tasks.{name}", params)
        self._check_attention()
        self.only = {task: require_list(f"[only] {task}", names, str, "cache labels")
                     for task, names in require_table("only", self.only).items()}  # fmt: skip
        self.model_caches = {model: require_list(f"[model_caches] {model}", names, str, "cache labels")
                             for model, names in require_table("model_caches", self.model_caches).items()}  # fmt: skip
        contexts = require_table("model_contexts", self.model_contexts)
        self.model_contexts = {model: require_list(f"[model_contexts] {model}", values, int, "integers")
                               for model, values in contexts.items()}  # fmt: skip
        by_context = require_table("context_caches", self.context_caches)
        self.context_caches = {str(c): require_list(f"[context_caches] {c}", names, str, "cache labels")
                               for c, names in by_context.items()}  # fmt: skip

    def _check_attention(self) -> None:
        unknown = sorted(set(require_table("attention", self.attention)) - set(_ATTENTION_KEYS))
        if unknown:
            raise ConfigError(f"[attention]: unknown key(s) {unknown}; accepted: {list(_ATTENTION_KEYS)}")
        for key, value in self.attention.items():
            if not _is_int(value) or value < 1:
                raise ConfigError(f"[attention] {key} must be an integer >= 1; got {key}={value!r}")

    # ------------------------------------------------------------------ derived
    def task_objects(self) -> dict[str, Task | dict[str, Any]]:
        """Task name -> task object (``speed`` -> its parameters)."""
        out: dict[str, Task | dict[str, Any]] = {}
        for name, params in self.tasks.items():
            if name == SPEED:
                out[name] = _speed_params(params, self.contexts)
            else:
                out[name] = make_task(name, **params)
        return out

    def contexts_of(self, task: str) -> list[int]:
        """Context lengths a task runs at (``[None]``-like single run for context-free tasks is the caller's)."""
        params = self.task_objects()[task]
        return params["contexts"] if isinstance(params, dict) else self.contexts

    def runs(self, task: str, label: str, model: str | None = None, context: int | None = None) -> bool:
        """Whether cache ``label`` (or the cache it was resized from) runs on ``task`` (see ``only``) and,
        given ``model``, on that model (see ``model_caches``) and, given ``context``, at that context (see
        ``context_caches``)."""
        base = label.rsplit("@", 1)[0]
        restrictions = (self.only.get(task), None if model is None else self.model_caches.get(model),
                        None if context is None else self.context_caches.get(str(context)))  # fmt: skip
        return all(names is None or label in names or base in names for names in restrictions)

    def attention_error_at(self, context: int | None) -> bool:
        """Whether quality cells at ``context`` measure ``attn_error`` (``attention_error``: true, false, or
        the contexts where it is measured; a context-free task follows any context that has it)."""
        if isinstance(self.attention_error, bool):
            return self.attention_error
        return bool(self.attention_error) if context is None else context in self.attention_error

    def runs_at(self, model: str, context: int) -> bool:
        """Whether ``model`` runs at ``context`` (see ``model_contexts``)."""
        return context in self.model_contexts.get(model, [context])

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (caches with their kind, args, label, exact description and canonical dict)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "caches"}
        d["caches"] = [
            {"label": c.label, "kind": c.kind, "args": _jsonable(c.args), "size_params": list(c.size_params),
             "resize": c.resize, "repr": c.describe(), "canonical": c.canonical()}
            for c in self.caches
        ]  # fmt: skip
        return d


def _speed_params(params: dict[str, Any], contexts: list[int]) -> dict[str, Any]:
    """Checked parameters of the ``speed`` task: ``steps``, ``repeats`` (integers >= 1) and ``contexts``.

    ``contexts`` is a list of integers, one integer, or a comma-separated string (``"512,1024"``,
    from ``--task speed:contexts=512,1024``); it defaults to the grid's contexts.
    """
    unknown = sorted(set(params) - set(_SPEED_KEYS))
    if unknown:
        raise ConfigError(f"task 'speed': unknown parameter(s) {unknown}; accepted: {list(_SPEED_KEYS)}")
    out: dict[str, Any] = {}
    for key, default in (("steps", 8), ("repeats", 1)):
        value = params.get(key, default)
        if not _is_int(value) or value < 1:
            raise ConfigError(f"task 'speed': {key} must be an integer >= 1; got {key}={value!r}")
        out[key] = value
    raw = params.get("contexts", contexts)
    values = _speed_contexts(raw)
    if not values or any(c < MIN_CONTEXT for c in values):
        raise ConfigError(
            f"task 'speed': contexts must be integers >= {MIN_CONTEXT} (a list, or comma-separated); "
            f"got contexts={raw!r}"
        )
    out["contexts"] = values
    return out


def _speed_contexts(raw: Any) -> list[int]:
    """``[512, 1024]``, ``1024`` or ``"512,1024"`` as a list of integers; ``[]`` for anything else."""
    if _is_int(raw):
        return [raw]
    items = raw.split(",") if isinstance(raw, str) else raw
    if not isinstance(items, (list, tuple)):
        return []
    try:
        values = [int(c) if isinstance(c, str) else c for c in items]
    except ValueError:
        return []
    return values if all(_is_int(c) for c in values) else []


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x if isinstance(x, (str, int, float, bool, type(None))) else repr(x)


#: the scheme of cell ids that :func:`cell_id` computes; each result row records it as ``cell_ids``. Scheme 1
#: (rows without ``cell_ids``) hashed the cache's ``repr``; scheme 2 hashes its canonical dict
#: (:meth:`~kvpolicy_lab.eval.caches.CacheSpec.canonical`). :mod:`kvpolicy_lab.eval.migrate_ids` moves a
#: directory from 1 to 2.
CELL_IDS = 2


def cell_key(model: str, cache: Any, context: int | None, task: str, task_params: dict, grid: Grid) -> dict[str, Any]:
    """Everything that determines a cell's result, as JSON data; ``cache`` is what names the cache
    (its canonical dict; a scheme-1 id had its ``repr`` there).

    ``decode`` enters the key of timing cells only: the fused and the materialised paths compute the
    same attention up to float rounding (tests/test_ablate_runner.py compares the two), so a quality cell
    measured on either stands for both, while their timings differ. ``batch`` enters no key: a batch
    gives each sample the result it gets alone, up to float rounding (tests/test_measure_batch.py).
    """
    key = {"model": model, "dtype": grid.dtype, "device": grid.device, "cache": cache, "context": context,
           "task": task, "params": _jsonable(task_params), "seed": grid.seed, "replay": grid.replay}  # fmt: skip
    if task == SPEED:
        key["decode"] = grid.decode
    elif not grid.attention_error_at(context):
        key["attention_error"] = False  # rows without attn_error; cells that have it keep their ids
    return key


def digest(key: dict[str, Any]) -> str:
    """The 16 hex digits a cell id is: SHA-1 of ``key`` as sorted JSON."""
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cell_id(model: str, spec: CacheSpec, context: int | None, task: str, task_params: dict, grid: Grid) -> str:
    """Stable id of a cell: a hash of everything that determines its result (:func:`cell_key`), the
    cache named by its canonical dict, so that how a cache prints changes no id."""
    return digest(cell_key(model, spec.canonical(), context, task, task_params, grid))


def cross_specs(cross: dict[str, Any]) -> list[CacheSpec]:
    """The cross product of policies × actions × bits × backends as cache specs.

    ``bits`` applies to actions that have a ``bits`` parameter, ``backends`` to actions that keep
    demoted tokens; action ``none`` gives one uncompressed spec whatever the policy.
    """
    from kvpolicy import registry

    unknown = sorted(set(require_table("cross", cross)) - _CROSS_KEYS)
    if unknown:
        raise ConfigError(f"[cross]: unknown key(s) {unknown}; accepted: {sorted(_CROSS_KEYS)}")
    names = lambda key, default: require_list(f"[cross] {key}", cross.get(key, default), str, "names")  # noqa: E731
    policies = [parse_named(p) for p in names("policies", ["log"])]
    actions = [parse_named(a) for a in names("actions", ["quantize"])]
    bits = require_list("[cross] bits", cross.get("bits", [2]), int, "integers")
    backends = [parse_named(b) for b in names("backends", ["torch"])]
    common = dict(require_table("cross.params", cross.get("params", {})))
    specs: list[CacheSpec] = []
    seen: set[str] = set()
    for pname, pparams in policies:
        registry.get("policies", pname)
        for aname, aparams in actions:
            acls = registry.get("actions", aname)
            fields = parameter_names(acls)
            bit_list = bits if "bits" in fields and "bits" not in aparams else [None]
            back_list = backends if getattr(acls, "keeps_demoted", True) and acls.compresses else backends[:1]
            for b in bit_list:
                for bname, bparams in back_list:
                    registry.get("backends", bname)
                    args: dict[str, Any] = {"policy": pname, "action": aname, **pparams, **aparams, **common}
                    if b is not None:
                        args["bits"] = b
                    if bname != "torch" or bparams:
                        args["backend"] = bname
                        args.update(bparams)
                    if not acls.compresses:
                        args = {"action": aname}
                    spec = CacheSpec("compressed", args)
                    desc = spec.validate()
                    if desc not in seen:
                        seen.add(desc)
                        specs.append(spec)
    return specs


def parse_baseline(text: str) -> CacheSpec:
    """``dynamic``, ``hf-quanto-2``, ``hf-hqq-4`` (optionally ``:residual_length=128:q_group_size=64``)."""
    name, params = parse_named(text)
    if name == "dynamic":
        return CacheSpec("dynamic", params)
    parts = name.split("-")
    if len(parts) == 3 and parts[0] == "hf" and parts[2].isdigit():
        return CacheSpec("hf-quantized", {"backend": parts[1], "nbits": int(parts[2]), **params})
    raise ConfigError(f"unknown baseline {text!r}; use 'dynamic', 'hf-quanto-<bits>' or 'hf-hqq-<bits>'")


def spec_from_entry(entry: dict[str, Any]) -> CacheSpec:
    """A ``[[caches]]`` entry -> CacheSpec."""
    if not isinstance(entry, dict):
        raise ConfigError(f"each [[caches]] entry must be a table (kind = ..., policy = ...); got {entry!r}")
    entry = dict(entry)
    kind = entry.pop("kind", "compressed")
    label = entry.pop("label", "")
    size = tuple(require_list("[[caches]] size_params", entry.pop("size_params", []), str, "parameter names"))
    resize = entry.pop("resize", True)
    return CacheSpec(kind, entry, label, size, resize)


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a TOML or JSON grid file into a dict."""
    from kvpolicy import textfile

    p = Path(path).expanduser()
    if p.suffix not in (".json", ".toml"):
        raise ConfigError(f"config file must end in .toml or .json; got {p.name!r}")
    load = textfile.load_json if p.suffix == ".json" else textfile.load_toml
    d = load(path, "config file")
    if not isinstance(d, dict):
        raise ConfigError(f"{p}: the top level must be an object of config keys; got a {type(d).__name__}")
    return d


def grid_from_dict(d: dict[str, Any]) -> Grid:
    """Build a :class:`Grid` from a config dict (file or flags)."""
    unknown = sorted(set(d) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown}; accepted: {sorted(_TOP_KEYS)}")
    entries = d.get("caches", [])
    if not isinstance(entries, list):
        raise ConfigError(f"caches must be a list of tables ([[caches]] entries); got caches={entries!r}")
    caches = [spec_from_entry(e) for e in entries]
    if d.get("cross"):
        caches += cross_specs(d["cross"])
    keys = ("models", "dtype", "device", "contexts", "seed", "replay", "decode", "equal_bytes", "online", "tasks",
            "attention", "only", "model_caches", "model_contexts", "context_caches", "attention_error",
            "batch")  # fmt: skip
    kwargs = {k: d[k] for k in keys if k in d}
    return Grid(caches=caches, **kwargs)


def check_model_available(name: str, online: bool) -> None:
    """Fail fast, before any work, for a model that cannot be loaded here."""
    import argparse

    from kvpolicy.commands._types import model_name
    from kvpolicy.tiny import parse_tiny
    from kvpolicy_lab.eval.gemma import ALIASES as GEMMA3

    try:
        model_name(name)  # a misspelt built-in name or tiny family: refused with the closest one
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(str(exc)) from None
    if parse_tiny(name) is not None or name.lower() in ("smollm2", "smollm2-135m", "smollm2-135m-instruct", *GEMMA3):
        return
    path = Path(name).expanduser()
    if path.exists():
        return
    if name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1:
        raise ConfigError(f"model path {name!r} does not exist")
    if online:
        return
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # an invalid repo id
        found = None
    if not isinstance(found, str):
        raise ConfigError(
            f"model {name!r} is not a local path, not a built-in name ('smollm2', 'gemma3-270m', 'tiny-llama') and "
            "not in the local Hugging Face cache; the hub is not contacted unless you pass --online"
        )
