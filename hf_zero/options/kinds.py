"""The value kinds of hf_zero's options: how a value is checked (`check`), read from a flag or an answer (`parse`),
described (`allowed`) and shown. Small frozen dataclasses, as PyTorch FSDP2 keeps its policies; a new kind needs
those methods and nothing else. Also `ZeroConfigError`, which every check raises."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping, Optional, Sequence, Tuple, Union


class ZeroConfigError(ValueError):
    """A ZeRO option has a value that is not allowed; the message names the option and the allowed values.

    `option` is the option's name when one option is to blame (None for a file-level problem)."""

    def __init__(self, message: str, option: Optional[str] = None) -> None:
        super().__init__(message)
        self.option = option


def _either(values: Sequence[Any]) -> str:
    """'a, b or c'."""
    shown = [str(v) for v in values]
    return shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"


def _integer_text(text: str) -> Optional[int]:
    """An integer from '25000000', '25_000_000' or '2.5e7'; None if the text is no whole number."""
    raw = text.strip().replace("_", "")
    try:
        return int(raw)
    except ValueError:
        try:
            f = float(raw)
        except (ValueError, OverflowError):
            return None
        return int(f) if f.is_integer() else None


def _ranks_or_word(text: str, words: dict, minimum: int, message: str) -> Any:
    """A number of ranks >= `minimum` from command-line text, or the value of one of `words`; else the error."""
    word = text.strip().lower()
    if word in words:
        return words[word]
    value = _integer_text(text)
    if value is None or value < minimum:
        raise argparse.ArgumentTypeError(f"{message}; got {text!r}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ------------------------------------------------------------------------------------------------ value kinds
class Kind:
    """How one option's values are checked (`check`), read from a flag or an answer (`parse`) and shown."""

    annotation: Any = Any
    metavar: Optional[str] = None

    def check(self, name: str, value: Any) -> Any:
        """The value in its normal form, or ZeroConfigError naming `name` and what is allowed."""
        raise NotImplementedError

    def parse(self, text: str, label: str) -> Any:
        """A value from command-line text, or argparse.ArgumentTypeError saying what `label` takes."""
        raise NotImplementedError

    def allowed(self) -> str:
        """What the option takes, in words (README table, messages)."""
        raise NotImplementedError

    def show(self, value: Any) -> str:
        """A value as a question's default shows it."""
        return str(value)

    def plain(self, value: Any) -> Any:
        """A value as YAML, JSON and logs hold it."""
        return value


@dataclass(frozen=True)
class Choice(Kind):
    """One of `values` (strings compare case-insensitively); `aliases` are other spellings of them, `none`
    (when given) says what None means, and `what` ends the message for anything else."""

    values: Tuple[Any, ...]
    aliases: Tuple[Tuple[Any, Any], ...] = ()
    none: Optional[str] = None
    what: str = "is not allowed"

    @property
    def annotation(self) -> Any:  # type: ignore[override]
        base = type(self.values[0])
        return Optional[base] if self.none else base

    @property
    def metavar(self) -> str:  # type: ignore[override]
        return "{" + ",".join(str(v) for v in self.values) + "}"

    def _match(self, value: Any) -> Any:
        for alias, target in self.aliases:
            if value is alias or (type(value) is type(alias) and value == alias):
                return target
        key = value.lower() if isinstance(value, str) else value
        for v in self.values:
            if type(v) is type(key) and v == key:
                return v
        for alias, target in self.aliases:  # string aliases compare case-insensitively too
            if isinstance(alias, str) and isinstance(key, str) and alias.lower() == key:
                return target
        raise KeyError(value)

    def check(self, name: str, value: Any) -> Any:
        if value is None and self.none:
            return None
        try:
            return self._match(value)
        except (KeyError, TypeError):
            raise ZeroConfigError(f"{name}={value!r} {self.what}; allowed: {self.allowed()}", name) from None

    def parse(self, text: str, label: str) -> Any:
        raw = text.strip()
        for v in self.values:
            if str(v).lower() == raw.lower():
                return v
        raise argparse.ArgumentTypeError(
            f"{label} must be one of {', '.join(str(v) for v in self.values)}; got {text!r}")

    def allowed(self) -> str:
        text = _either(self.values)
        spellings = [f"{a} means {t}" for a, t in self.aliases if isinstance(a, str)]
        if spellings:
            text += f" ({', '.join(spellings)})"
        if self.none:
            text += f", or None ({self.none})"
        return text


@dataclass(frozen=True)
class Integer(Kind):
    """An integer >= `minimum`; `unit` says what it counts."""

    minimum: int
    unit: str
    annotation: ClassVar[Any] = int
    metavar: ClassVar[str] = "N"

    def check(self, name: str, value: Any) -> Any:
        if not _is_int(value) or value < self.minimum:
            raise ZeroConfigError(f"{name}={value!r} must be an integer >= {self.minimum} ({self.unit})", name)
        return value

    def parse(self, text: str, label: str) -> Any:
        value = _integer_text(text)
        if value is None or value < self.minimum:
            raise argparse.ArgumentTypeError(f"{label} must be an integer >= {self.minimum} ({self.unit}); "
                                             f"got {text!r}")
        return value

    def allowed(self) -> str:
        return f"integer >= {self.minimum} ({self.unit})"


@dataclass(frozen=True)
class Bytes(Kind):
    """A positive number of bytes, kept as an int (25_000_000 and 2.5e7 alike)."""

    annotation: ClassVar[Any] = int
    metavar: ClassVar[str] = "BYTES"

    def check(self, name: str, value: Any) -> Any:
        if not _is_number(value) or value <= 0:
            raise ZeroConfigError(f"{name}={value!r} must be a positive number of bytes (e.g. 25_000_000)", name)
        return int(value)

    def parse(self, text: str, label: str) -> Any:
        value = _integer_text(text)
        if value is None or value < 1:
            raise argparse.ArgumentTypeError(f"{label} must be a positive integer number of bytes (e.g. 25000000); "
                                             f"got {text!r}")
        return value

    def allowed(self) -> str:
        return "positive integer (bytes)"


@dataclass(frozen=True)
class Number(Kind):
    """A real number above `above` (or equal to it, with `inclusive`); kept as given."""

    above: float
    inclusive: bool = False
    annotation: ClassVar[Any] = float
    metavar: ClassVar[str] = "X"

    def _bound(self) -> str:
        return f"{'>=' if self.inclusive else '>'} {self.above:g}"

    def check(self, name: str, value: Any) -> Any:
        if not _is_number(value) or value < self.above or (value == self.above and not self.inclusive):
            raise ZeroConfigError(f"{name}={value!r} must be a number {self._bound()}", name)
        return value

    def parse(self, text: str, label: str) -> Any:
        try:
            value = float(text.strip().replace("_", ""))
        except ValueError:
            value = None
        if value is None or value < self.above or (value == self.above and not self.inclusive):
            raise argparse.ArgumentTypeError(f"{label} must be a number {self._bound()}; got {text!r}")
        return value

    def allowed(self) -> str:
        return f"number {self._bound()}"


@dataclass(frozen=True)
class GroupSize(Kind):
    """K ranks for a hierarchical option: a positive integer, "host" (the ranks per host) or None (off)."""

    annotation: ClassVar[Any] = Optional[Union[int, str]]
    metavar: ClassVar[str] = "{K,host}"

    def check(self, name: str, value: Any) -> Any:
        if isinstance(value, str) and value.lower() == "host":
            return "host"
        if value is not None and (not _is_int(value) or value < 1):
            raise ZeroConfigError(f"{name}={value!r} must be a positive number of ranks that divides the world "
                                  f"size, \"host\" (the ranks per host) or None (off)", name)
        return value

    def parse(self, text: str, label: str) -> Any:
        return _ranks_or_word(text, {"host": "host"}, 1, f'{label} must be a positive number of ranks or "host"')

    def allowed(self) -> str:
        return 'K ranks (divides the world size), "host" (the ranks per host) or None (off)'


@dataclass(frozen=True)
class Flag(Kind):
    """true or false (or None too, with `optional`)."""

    optional: bool = False

    @property
    def annotation(self) -> Any:  # type: ignore[override]
        return Optional[bool] if self.optional else bool

    def check(self, name: str, value: Any) -> Any:
        if not isinstance(value, bool) and not (value is None and self.optional):
            allowed = "true, false or None" if self.optional else "true or false"
            raise ZeroConfigError(f"{name}={value!r}; allowed: {allowed}", name)
        return value

    def parse(self, text: str, label: str) -> Any:
        value = {"yes": True, "y": True, "no": False, "n": False}.get(text.strip().lower())
        if value is None:
            raise argparse.ArgumentTypeError(f"{label}: answer yes or no; got {text!r}")
        return value

    def allowed(self) -> str:
        return "true, false or None" if self.optional else "true or false"

    def show(self, value: Any) -> str:
        return {True: "yes", False: "no"}.get(value, str(value))


@dataclass(frozen=True)
class ClassNames(Kind):
    """None, or a list of module classes or class names."""

    annotation: ClassVar[Any] = Optional[Sequence[Union[str, type]]]
    metavar: ClassVar[str] = "NAME[,NAME...]"

    def check(self, name: str, value: Any) -> Any:
        ok = value is None or (not isinstance(value, (str, bytes)) and isinstance(value, Iterable)
                               and all(isinstance(u, (str, type)) for u in value))
        if not ok:
            raise ZeroConfigError(f"{name}={value!r} must be a list of module classes or class names (e.g. "
                                  f"['LlamaDecoderLayer']) or None", name)
        return value

    def parse(self, text: str, label: str) -> Any:
        names = [n.strip() for n in text.split(",") if n.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"{label} must be class names separated by commas; got {text!r}")
        return names

    def allowed(self) -> str:
        return "module classes or class names, or None"

    def plain(self, value: Any) -> Any:
        return None if value is None else [u if isinstance(u, str) else u.__name__ for u in value]


@dataclass(frozen=True)
class Reshard(Kind):
    """Stage 3's reshard-after-forward policy: "auto" (every unit but the last), true, false, or K ranks (reshard
    to the hpZ group of K: keep a secondary partition over K ranks between the forward and the backward)."""

    annotation: ClassVar[Any] = Union[bool, int, str]
    metavar: ClassVar[str] = "{auto,true,false,K}"

    def check(self, name: str, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, bool) or (_is_int(value) and value >= 2):
            return value
        raise ZeroConfigError(f"{name}={value!r}; allowed: \"auto\" (every unit but the last), true, false, or a "
                              f"number of ranks K >= 2 that divides the world size (reshard to the hpZ group of K)",
                              name)

    def parse(self, text: str, label: str) -> Any:
        words = {"auto": "auto", "true": True, "yes": True, "false": False, "no": False}
        return _ranks_or_word(text, words, 2, f"{label} takes auto, true, false or a number of ranks >= 2")

    def allowed(self) -> str:
        return '"auto" (every unit but the last), true, false, or K ranks (reshard to the hpZ group of K)'

    def show(self, value: Any) -> str:
        return {True: "true", False: "false"}.get(value, str(value))


@dataclass(frozen=True)
class Overrides(Kind):
    """None, or a mapping of module names (a unit's qualified name, or its class name) to true or false."""

    annotation: ClassVar[Any] = Optional[Mapping[str, bool]]
    metavar: ClassVar[str] = "NAME=BOOL[,NAME=BOOL...]"

    def check(self, name: str, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, bool)
                                                     for k, v in value.items()):
            raise ZeroConfigError(f"{name}={value!r} must map module names (a unit's qualified name such as "
                                  f"'model.layers.3', or a class name such as 'LlamaDecoderLayer') to true or false, "
                                  f"or be None", name)
        return dict(value)

    def parse(self, text: str, label: str) -> Any:
        out = {}
        for item in (i.strip() for i in text.split(",") if i.strip()):
            key, _, word = item.partition("=")
            flag = {"true": True, "yes": True, "false": False, "no": False}.get(word.strip().lower())
            if not key.strip() or flag is None:
                raise argparse.ArgumentTypeError(f"{label} takes NAME=true/false pairs separated by commas; "
                                                 f"got {item!r}")
            out[key.strip()] = flag
        return out

    def allowed(self) -> str:
        return "a mapping of unit names or class names to true/false, or None"
