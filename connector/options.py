"""One typed table per option set: parsing and docs/options.md both read it. Driver side.

Each format (the ``lastagent-kafka`` source and sink, the ``lastagent-delta`` sink) declares its
options once as an :class:`OptionTable` of :class:`Option` rows: name, type, default, bounds and
description. The format's ``parse()`` reads typed values through the table, so a bound such as
``phase2Parallelism >= 1`` is checked where it is documented, and ``python -m
lastagent.options_doc`` renders the same rows into docs/options.md. All of it runs on the driver
at query start.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from lastagent.errors import OptionError

#: The option types: ``list`` is comma-separated, ``json`` a JSON text, ``choice`` one of
#: :attr:`Option.choices` (case-insensitive).
TYPES = ("string", "integer", "boolean", "list", "json", "choice")


@dataclass(frozen=True)
class Option:
    """One option of a format, as parsed and as documented.

    Attributes:
        name: the option's name as documented (Spark matches it case-insensitively).
        type: one of :data:`TYPES`.
        default: the value used when the option is not given; "" for an optional option without
            a value, None when the option is required.
        doc: what the option means, one paragraph (rendered in docs/options.md).
        minimum: integer options: the smallest value accepted, or None.
        maximum: integer options: the largest value accepted, or None.
        choices: choice options: the accepted values, lower case.
        max_length: string options: the most characters accepted, or None.
    """

    name: str
    type: str
    default: str | None
    doc: str
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[str, ...] = ()
    max_length: int | None = None

    def __post_init__(self) -> None:
        """Refuses an inconsistent declaration (a bug in a table, found at import)."""
        def bad(why: str) -> ValueError:
            return ValueError(f"option table: {self.name!r}: {why}")

        if self.type not in TYPES:
            raise bad(f"type {self.type!r} is not one of {', '.join(TYPES)}")
        if (self.minimum is not None or self.maximum is not None) and self.type != "integer":
            raise bad("minimum and maximum are for integer options")
        if self.minimum is not None and self.maximum is not None and self.minimum > self.maximum:
            raise bad(f"minimum {self.minimum} is above maximum {self.maximum}")
        if bool(self.choices) != (self.type == "choice"):
            raise bad("a choice option needs choices, and only a choice option has them")
        if any(c != c.lower() for c in self.choices):
            raise bad("choices are matched case-insensitively; declare them in lower case")
        if self.max_length is not None and (self.type != "string" or self.max_length < 1):
            raise bad("max_length is a positive length of a string option")
        default = (self.default or "").strip()
        if not default:
            return
        if self.type == "integer":
            try:
                value = int(default)
            except ValueError:
                raise bad(f"default {default!r} is not an integer") from None
            if not self._in_bounds(value):
                raise bad(f"default {value} is not {self.range_text()}")
        elif self.type == "boolean" and default.lower() not in ("true", "false"):
            raise bad(f"default {default!r} is not true or false")
        elif self.type == "choice" and default.lower() not in self.choices:
            raise bad(f"default {default!r} is not one of {', '.join(self.choices)}")
        elif self.max_length is not None and len(default) > self.max_length:
            raise bad(f"default {default!r} is longer than {self.max_length}")

    @property
    def required(self) -> bool:
        """True when the option has no default and must be given."""
        return self.default is None

    def _in_bounds(self, value: int) -> bool:
        return ((self.minimum is None or value >= self.minimum)
                and (self.maximum is None or value <= self.maximum))

    def _whole_number(self) -> str:
        """The words an integer error ends with, e.g. "a whole number >= 1"."""
        if self.minimum is not None and self.maximum is not None:
            return f"a whole number from {self.minimum} to {self.maximum}"
        bound = self.range_text()
        return f"a whole number {bound}" if bound else "a whole number"

    def range_text(self) -> str:
        """The accepted values in words for the docs' range column, or "" when any value goes.

        Examples: ``>= 1``, ``<= 10``, ``1 to 10`` (integers, inclusive), ``1 to 44 characters``
        (a required string with a length limit), ``error, latest`` (choices).
        """
        if self.type == "integer":
            if self.minimum is not None and self.maximum is not None:
                return f"{self.minimum} to {self.maximum}"
            if self.minimum is not None:
                return f">= {self.minimum}"
            if self.maximum is not None:
                return f"<= {self.maximum}"
        if self.type == "choice":
            return ", ".join(self.choices)
        if self.max_length is not None:
            return f"1 to {self.max_length} characters" if self.required else f"at most {self.max_length} characters"
        return ""


class OptionRow(NamedTuple):
    """One row of the docs' option table (plain text; the renderer formats it)."""

    name: str
    type: str
    default: str | None
    range: str
    doc: str


class OptionTable:
    """The options of one format: case-insensitive lookup, typed readers, docs rows.

    The readers take the option map with lower-cased keys, as each format's ``parse()`` builds
    it from Spark's options, and raise :class:`~lastagent.errors.OptionError` naming the option
    and what would be right. They run on the driver at query start.
    """

    def __init__(self, options: Iterable[Option], *, exempt: Iterable[str] = (),
                 exempt_prefixes: Iterable[str] = ("kafka.",), others: str = "",
                 blank_integer_is_unset: bool = False) -> None:
        """Builds the table.

        Args:
            options: the rows, in documentation order.
            exempt: lower-case names accepted without being options (e.g. ``path``, which Spark
                passes to every data source).
            exempt_prefixes: names starting with one of these pass through (``kafka.*`` to the Kafka
                client, ``storage.*`` to the storage clients).
            others: what the unknown-option message adds after the valid names, e.g.
                "kafka.* consumer settings".
            blank_integer_is_unset: a blank value of an integer option reads as not given (its
                default), as in the source; otherwise a blank is "not an integer".

        Raises:
            ValueError: two options share a name (ignoring case).
        """
        self._options: dict[str, Option] = {}
        for option in options:
            key = option.name.lower()
            if key in self._options:
                raise ValueError(f"option table: {option.name!r} is declared twice")
            self._options[key] = option
        self._exempt = frozenset(e.lower() for e in exempt)
        self._exempt_prefixes = tuple(p.lower() for p in exempt_prefixes)
        self._others = others
        self._blank_integer_is_unset = blank_integer_is_unset

    def __iter__(self) -> Iterator[Option]:
        return iter(self._options.values())

    def __len__(self) -> int:
        return len(self._options)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._options

    def __getitem__(self, name: str) -> Option:
        """The option called ``name``, matched case-insensitively.

        Raises:
            KeyError: no such option (a bug in the caller, not a user error).
        """
        try:
            return self._options[name.lower()]
        except KeyError:
            raise KeyError(f"no option {name!r} in this table") from None

    @property
    def names(self) -> tuple[str, ...]:
        """The option names as documented, in table order."""
        return tuple(o.name for o in self._options.values())

    def _typed(self, name: str, kind: str) -> Option:
        option = self[name]
        if option.type != kind:
            raise TypeError(f"option {option.name!r} is declared {option.type}, not {kind}")
        return option

    def raw(self, opts: Mapping[str, str], name: str) -> str:
        """The user's value of ``name`` as given, else its default ("" for a required option)."""
        option = self[name]
        value = opts.get(option.name.lower())
        if value is None:
            return option.default or ""
        return str(value)

    def integer(self, opts: Mapping[str, str], name: str) -> int | None:
        """An integer option, checked against its bounds; None when blank and without a default.

        Raises:
            OptionError: not a whole number, or outside the option's bounds.
        """
        option = self._typed(name, "integer")
        text = self.raw(opts, name).strip()
        if not text and self._blank_integer_is_unset:
            text = (option.default or "").strip()
        if not text and not (option.default or "").strip():
            return None
        try:
            value = int(text)
        except ValueError:
            raise OptionError(option.name, f"{text!r} is not an integer; give {option._whole_number()}") from None
        if option.minimum is not None and value < option.minimum:
            raise OptionError(option.name, f"{value} is too small; give {option._whole_number()}")
        if option.maximum is not None and value > option.maximum:
            raise OptionError(option.name, f"{value} is too large; give {option._whole_number()}")
        return value

    def integer_value(self, opts: Mapping[str, str], name: str) -> int:
        """:meth:`integer` of an option that always has a value (a default, or required).

        Raises:
            OptionError: as :meth:`integer`, or the option is blank and has no default.
        """
        value = self.integer(opts, name)
        if value is None:
            option = self[name]
            raise OptionError(option.name, f"is required; give {option._whole_number()}")
        return value

    def boolean(self, opts: Mapping[str, str], name: str) -> bool:
        """A boolean option: ``true`` or ``false`` in any case.

        Raises:
            OptionError: anything else.
        """
        option = self._typed(name, "boolean")
        text = self.raw(opts, name).strip().lower()
        if text not in ("true", "false"):
            raise OptionError(option.name, f"{text!r} is not a boolean; give true or false")
        return text == "true"

    def choice(self, opts: Mapping[str, str], name: str) -> str:
        """A choice option, lower case.

        Raises:
            OptionError: not one of the option's choices.
        """
        option = self._typed(name, "choice")
        text = self.raw(opts, name).strip().lower()
        if text not in option.choices:
            *head, last = option.choices
            listed = f"{', '.join(head)} or {last}" if head else last
            raise OptionError(option.name, f"{text!r} is not valid; give {listed}")
        return text

    def comma_list(self, opts: Mapping[str, str], name: str) -> tuple[str, ...]:
        """A list option: its comma-separated items, stripped, blanks dropped."""
        self._typed(name, "list")
        return tuple(n.strip() for n in self.raw(opts, name).split(",") if n.strip())

    def check_known(self, key: str, what: str) -> None:
        """Refuses a name that is neither an option nor exempt, suggesting the nearest option.

        Args:
            key: the name as the user gave it (the error names it so).
            what: the format, e.g. "the lastagent-kafka source".

        Raises:
            OptionError: "unknown option for <what>; did you mean '<option>'? valid options: ...".
        """
        lower = key.lower()
        if lower in self._options or lower in self._exempt or lower.startswith(self._exempt_prefixes):
            return
        valid = ", ".join(sorted(o.name for o in self if not o.name.startswith("kafka.")))
        near = difflib.get_close_matches(lower, list(self._options), n=1)
        hint = f"did you mean '{self._options[near[0]].name}'? " if near else ""
        others = f", and {self._others}" if self._others else ""
        raise OptionError(key, f"unknown option for {what}; {hint}valid options: {valid}{others}")

    def rows(self) -> list[OptionRow]:
        """The table for docs/options.md, in declaration order."""
        return [OptionRow(o.name, o.type, o.default, o.range_text(), o.doc) for o in self]


# -- durations, pure ------------------------------------------------------------------------------

_UNITS_MS = {"ms": 1, "millisecond": 1, "milliseconds": 1, "s": 1000, "second": 1000, "seconds": 1000,
             "m": 60_000, "min": 60_000, "minute": 60_000, "minutes": 60_000, "h": 3_600_000, "hour": 3_600_000,
             "hours": 3_600_000, "d": 86_400_000, "day": 86_400_000, "days": 86_400_000}
_XSD_DURATION = re.compile(r"^P(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+(?:\.\d+)?)S)?)?$")


def parse_duration(value: Any, what: str) -> int:
    """Milliseconds of a duration: an integer (ms), ``"<n> <unit>"`` (ms, seconds, minutes, hours,
    days) or an xsd:duration of days and times (``PT30S``, ``P1DT2H``).

    Raises:
        ValueError: naming ``what`` and the forms accepted.
    """
    if isinstance(value, bool):
        raise ValueError(f"{what}: {value!r} is not a duration")
    if isinstance(value, int):
        ms = value
    else:
        text = str(value).strip()
        m = re.fullmatch(r"(\d+)\s*([a-zA-Z]*)", text)
        x = _XSD_DURATION.match(text)
        if m and (m.group(2) == "" or m.group(2).lower() in _UNITS_MS):
            ms = int(m.group(1)) * _UNITS_MS.get(m.group(2).lower(), 1)
        elif x and text != "P" and not text.endswith("T"):
            d, h, mi, s = x.groups()
            ms = (int(d or 0) * 86_400_000 + int(h or 0) * 3_600_000 + int(mi or 0) * 60_000
                  + round(float(s or 0) * 1000))
        else:
            raise ValueError(f"{what}: {text!r} is not a duration; give milliseconds (30000), '<n> <unit>' "
                             "('30 seconds', '10 minutes') or an xsd:duration without years or months ('PT30S')")
    if ms <= 0:
        raise ValueError(f"{what}: {value!r} is not a positive duration")
    return ms
