"""Model presets: which preset file suits which model, as declarative data a plugin (or kvpolicy) registers.

A distribution that measured a composition winning clearly on one model ships it as a preset file inside its
package and registers a :class:`ModelPreset` through the hook ``kvpolicy_register_model_presets`` (see
docs/how-to/write-a-plugin.md). An entry names the models it suits (their config's ``model_type``, and
optionally config fields that must equal given values), the file, and the measurement that earned it. Nothing
in an entry runs code: the registry checks each one when the plugins load (:func:`problem`), and the file is
read as untrusted input like any preset file.

:func:`suggest` lists the entries that suit a model; :func:`choose` is the one decision behind
``CompressedCache.for_model(model, "auto")``: the suggested preset file when exactly one suits the model, else
the default composition, with the reason either way.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from kvpolicy.errors import ConfigError

#: a transformers ``model_type`` (``"llama"``, ``"gemma3_text"``)
MODEL_TYPE = re.compile(r"[a-z][a-z0-9_]{0,63}")
#: a config field an entry may match on
FIELD = re.compile(r"[a-z_][a-z0-9_]{0,63}")
#: a package's dotted name
PACKAGE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
#: the longest evidence line
MAX_EVIDENCE = 400
#: what ``for_model`` takes as the preset to mean "the model preset that suits this model, else the default"
AUTO = "auto"


@dataclass(frozen=True)
class ModelPreset:
    """A preset file that suits some models, and the measurement behind it.

    Parameters
    ----------
    model_types : tuple of str
        The configs' ``model_type`` values it suits (the model's own config or its text config), e.g.
        ``("gemma3", "gemma3_text")``.
    package : str
        The importable package that holds the file (the providing distribution's own package).
    file : str
        The preset file's path inside ``package``: relative, ``/``-separated, ending in ``.toml``.
    evidence : str
        One line: the measurement that earned the entry (model, context, bits, quality, against what).
    fields : tuple of (str, value) pairs, optional
        Config fields that must equal the given values (``(("head_dim", 256),)``), read from the text config;
        a mapping is accepted and stored sorted.

    Raises
    ------
    ConfigError
        A value of the wrong type or form, naming the parameter, the value and what is allowed.
    """

    model_types: tuple[str, ...]
    package: str
    file: str
    evidence: str
    fields: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        types = self.model_types
        if isinstance(types, str) or not isinstance(types, (tuple, list)) or not types:
            raise ConfigError(f"ModelPreset: model_types must be a non-empty tuple of model_type names; got {types!r}")
        for value in types:
            if not isinstance(value, str) or not MODEL_TYPE.fullmatch(value):
                raise ConfigError(
                    f"ModelPreset: model_types holds {value!r}; a model_type is lower-case letters, digits and _ "
                    "as in a transformers config (e.g. 'llama', 'gemma3_text')"
                )
        object.__setattr__(self, "model_types", tuple(types))
        if not isinstance(self.package, str) or not PACKAGE.fullmatch(self.package):
            raise ConfigError(f"ModelPreset: package must be an importable package's dotted name; got {self.package!r}")
        file = self.file
        parts = PurePosixPath(file).parts if isinstance(file, str) else ()
        if (
            not isinstance(file, str)
            or not file.endswith(".toml")
            or "\\" in file
            or file.startswith(("/", "~"))
            or any(part in ("..", ".") for part in parts)
        ):
            raise ConfigError(
                f"ModelPreset: file must be a relative '/'-separated path ending in .toml inside package "
                f"{self.package!r}, without '..'; got {file!r}"
            )
        evidence = self.evidence
        if not isinstance(evidence, str) or not evidence.strip() or "\n" in evidence or len(evidence) > MAX_EVIDENCE:
            raise ConfigError(
                f"ModelPreset: evidence must be one non-empty line of at most {MAX_EVIDENCE} characters (the "
                f"measurement); got {evidence!r:.120}"
            )
        fields = self.fields
        pairs = list(fields.items()) if isinstance(fields, Mapping) else list(fields)
        checked = []
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ConfigError(f"ModelPreset: fields must map config field names to values; got {fields!r}")
            key, value = pair
            if not isinstance(key, str) or not FIELD.fullmatch(key):
                raise ConfigError(f"ModelPreset: fields names the config field {key!r}; expected a field name")
            if not isinstance(value, (bool, int, float, str)):
                raise ConfigError(f"ModelPreset: fields[{key!r}] = {value!r}; a value is a bool, int, float or str")
            checked.append((key, value))
        object.__setattr__(self, "fields", tuple(sorted(checked)))

    @staticmethod
    def problem_of(entry: object, owner: str | None = None) -> str | None:
        """What is wrong with ``entry`` as a registered model preset: :func:`problem`."""
        return problem(entry, owner)

    def path(self) -> Path:
        """The preset file, resolved inside its package.

        Raises
        ------
        ConfigError
            The package cannot be found, or the file is missing, not a regular file, too large, or resolves
            (through a link) outside the package.
        """
        from kvpolicy.preset_source import MAX_FILE_BYTES

        try:
            spec = importlib.util.find_spec(self.package)
        except (ImportError, ValueError):
            spec = None
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
        if not roots:
            raise ConfigError(f"ModelPreset: package {self.package!r} is not an importable package")
        for root in roots:
            base = Path(root).resolve()
            candidate = (base / self.file).resolve()
            if not candidate.is_relative_to(base):
                raise ConfigError(
                    f"ModelPreset: file {self.file!r} resolves to {candidate}, outside package {self.package!r}"
                )
            if candidate.is_file():
                if candidate.stat().st_size > MAX_FILE_BYTES:
                    raise ConfigError(f"ModelPreset: file {self.file!r} is larger than {MAX_FILE_BYTES} bytes")
                return candidate
        raise ConfigError(f"ModelPreset: file {self.file!r} does not exist in package {self.package!r}")

    def suits(self, config: Any) -> bool:
        """Whether the model of ``config`` (a transformers config) is one this entry suits."""
        text = _text_config(config)
        types = {getattr(config, "model_type", None), getattr(text, "model_type", None)}
        if not types & set(self.model_types):
            return False
        missing = object()
        return all(getattr(text, key, missing) == value for key, value in self.fields)

    def describe(self) -> str:
        """``model_type gemma3_text`` (with the fields) for messages."""
        fields = "".join(f", {key}={value!r}" for key, value in self.fields)
        return f"model_type {' or '.join(self.model_types)}{fields}"


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def problem(entry: object, owner: str | None = None) -> str | None:
    """What is wrong with ``entry`` as a registered model preset (``None`` if nothing): not a
    :class:`ModelPreset`, its file missing or outside its package, or a package other than ``owner``'s
    (the top-level package of the plugin registering it)."""
    if not isinstance(entry, ModelPreset):
        return f"{entry!r:.80} ({type(entry).__name__}) is not a kvpolicy.model_presets.ModelPreset"
    top = entry.package.partition(".")[0]
    if owner is not None and top != owner:
        return (
            f"its file is in package {entry.package!r}, not in the registering plugin's own package {owner!r}; a "
            "model preset ships inside the distribution that registers it"
        )
    try:
        entry.path()
    except ConfigError as exc:
        return str(exc).removeprefix("ModelPreset: ")
    return None


@dataclass(frozen=True)
class Suggestion:
    """A registered model preset that suits a model.

    Attributes
    ----------
    name : str
        The name it is registered under.
    entry : ModelPreset
    provider : kvpolicy.registry.Source
        The distribution that registered it.
    """

    name: str
    entry: ModelPreset
    provider: Any

    def __str__(self) -> str:
        return (
            f"{self.name} (preset file {self.entry.file} of {self.provider.distribution}, for "
            f"{self.entry.describe()}): {self.entry.evidence}"
        )


def _config(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    if not hasattr(config, "model_type"):
        raise ConfigError(
            f"a model or a transformers config (with model_type) is needed; got {type(model_or_config).__name__}"
        )
    return config


def suggest(model_or_config: Any) -> list[Suggestion]:
    """The registered model presets that suit a model, by name.

    Parameters
    ----------
    model_or_config : transformers.PreTrainedModel or transformers.PretrainedConfig

    Returns
    -------
    list of Suggestion
        Empty when none is registered for the model (the core registers none; plugins do).
    """
    from kvpolicy import registry

    config = _config(model_or_config)
    return [
        Suggestion(name, entry, source)
        for name, entry, source in registry.entries("model_presets")
        if entry.suits(config)
    ]


def choose(model_or_config: Any) -> tuple[Any, str]:
    """What ``for_model(model, "auto")`` builds: the suggested model preset, or the default composition.

    Returns
    -------
    (PresetSource, str)
        The source (kind ``"model preset"``, or ``"default"`` for ``CompressedCache()``'s defaults) and why.

    Raises
    ------
    ConfigError
        More than one registered model preset suits the model (the message lists them: pass one by name), or
        two distributions register a model preset under one name (it might suit the model: no choice is safe).
    """
    from kvpolicy import registry
    from kvpolicy.preset_source import PresetSource

    clashes = registry.conflicts("model_presets")
    if clashes:
        raise clashes[0].error()
    config = _config(model_or_config)
    found = suggest(config)
    model_type = getattr(_text_config(config), "model_type", None)
    if not found:
        reason = f"the default composition: no model preset is registered for model_type {model_type!r}"
        return PresetSource(AUTO, "default", reason=reason), reason
    if len(found) > 1:
        listed = "; ".join(str(s) for s in found)
        raise ConfigError(
            f"preset='auto': {len(found)} model presets suit model_type {model_type!r}: {listed}. Pass one of "
            f"them by name ({', '.join(s.name for s in found)})"
        )
    chosen = found[0]
    reason = (
        f"{chosen.name}, the model preset of {chosen.provider.distribution} for {chosen.entry.describe()} "
        f"({chosen.entry.evidence})"
    )
    return PresetSource(chosen.name, "model preset", chosen.entry.path(), reason=reason), reason
