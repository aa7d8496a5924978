"""HOCON substitutions (``${a.b}``, ``${?NAME}``) resolved from the document alone, never the environment.

pyhocon answers a substitution that the document does not define from ``os.environ``, in two
places: its main resolution, and its handling of self-references (``path = ${?path}":/x"``, and
``key += value``, which it reads as ``key = ${?key} value``). A job sent to a server must not read
that server's environment (``name = ${?AWS_SECRET_ACCESS_KEY}`` would hand the secret to the
job's submitter), so:

- `environment_references` finds, before anything is resolved, every substitution pyhocon would
  answer from the environment: one the document does not define, one that reaches a null, and a
  self-reference with nothing earlier to refer to;
- `resolve` with ``environment=False`` resolves the rest with a parser that has no environment to
  fall back on, should a case slip past the first check.

pyhocon copies what a substitution refers to, so ten lines of ``a{i} = [${a{i-1}}, ${a{i-1}}]``
would resolve to a thousand copies, and thirty to a billion: `expanded_size` tells beforehand.

Example::

    tree = ConfigFactory.parse_file(path, resolve=False)
    if not environment_references(tree):
        resolve(tree, environment=False)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pyhocon import ConfigParser, ConfigTree
from pyhocon.config_tree import ConfigSubstitution, ConfigValues, NoneValue
from pyhocon.exceptions import ConfigMissingException, ConfigSubstitutionException
from pyparsing import col, lineno

from engine.config.problems import KeyPath

_MISSING = object()


@dataclass(frozen=True)
class EnvironmentReference:
    """A substitution that pyhocon would answer from the process environment.

    Attributes:
        key_path: Where the substitution is written, e.g. ``("workflows", 0, "args", "name")``;
            quoted keys keep their quotes, as in pyhocon's tree.
        variable: The name substituted, e.g. ``AWS_SECRET``.
        optional: Written ``${?NAME}``.
        appends: Written ``key += value`` (pyhocon's implicit ``${?key}``).
        null: The document defines the name, as null (pyhocon then reads the environment).
        source: The text of the file it is written in, to find its line; None when pyhocon
            does not keep it (``+=``).
        offset: Where in ``source`` it is written.
    """

    key_path: KeyPath
    variable: str
    optional: bool
    appends: bool
    null: bool
    source: str | None
    offset: int

    @property
    def written(self) -> str:
        """The substitution as written, e.g. ``${?HOME}``."""
        return f"${{{'?' if self.optional else ''}{self.variable}}}"

    @property
    def line(self) -> int | None:
        """1-based line of the substitution in ``source``, when known."""
        return lineno(self.offset, self.source) if self.source is not None else None


def environment_references(tree: Any) -> list[EnvironmentReference]:
    """Return every substitution of an unresolved pyhocon tree that pyhocon would read from the environment.

    Args:
        tree: What ``ConfigFactory.parse_file(..., resolve=False)`` returned, includes merged in.

    Returns:
        The references, in the order they are written in the tree; empty when resolving the tree
        reads nothing but the tree.
    """
    if not isinstance(tree, ConfigTree):
        return []  # `resolve` leaves a list at the top level alone; a config must be an object
    found = []
    for key_path, substitution in _substitutions(tree):
        reason = _environment_reason(tree, key_path, substitution)
        if reason is None:
            continue
        # pyhocon builds the implicit `${?key}` of `key += value` without the text it came from
        source = substitution.instring if isinstance(substitution.instring, str) else None
        found.append(
            EnvironmentReference(
                key_path,
                substitution.variable,
                substitution.optional,
                appends=source is None,
                null=reason == "null",
                source=source,
                offset=substitution.loc,
            )
        )
    return found


def resolve(tree: Any, *, environment: bool = True) -> None:
    """Resolve the substitutions of an unresolved pyhocon tree in place, as ``resolve=True`` would.

    Args:
        tree: What ``ConfigFactory.parse_file(..., resolve=False)`` returned.
        environment: Whether a name the tree does not define may come from ``os.environ``
            (pyhocon's behaviour). With False it is unresolved: an error, or nothing for ``${?NAME}``.

    Raises:
        ConfigException: As pyhocon raises it (an unresolved or cyclic substitution...).
    """
    if not isinstance(tree, ConfigTree):
        return
    parser = ConfigParser if environment else _DocumentOnlyParser
    parser.resolve_substitutions(tree)


def expanded_size(tree: Any, limit: int) -> int:
    """Return how many values resolving an unresolved pyhocon tree makes, at most; counting stops past ``limit``.

    Each substitution counts as a copy of what it refers to (pyhocon copies it), a
    self-reference (``a = ${a} [1]``) as the value it overrides, and every list and object as
    one value besides its items. An upper bound: a concatenation of objects counts each in full.

    Args:
        tree: What ``ConfigFactory.parse_string(..., resolve=False)`` returned.
        limit: Any count above it is returned as ``limit + 1``.
    """
    if not isinstance(tree, ConfigTree):
        return 0
    sizes: dict[int, int] = {}
    parts: dict[int, list[Any]] = {}
    open_values: set[int] = set()
    pending: list[tuple[Any, ConfigValues | None, bool]] = [(tree, None, False)]  # (value, owner, parts counted)
    while pending:
        value, owner, counted = pending.pop()
        if counted:
            open_values.discard(id(value))
            own = 1 if isinstance(value, (ConfigTree, list)) else 0
            sizes[id(value)] = min(limit + 1, own + sum(sizes.get(id(part), 1) for part in parts.pop(id(value))))
            continue
        if id(value) in sizes or id(value) in open_values:
            continue
        found = _parts(tree, value, owner, open_values)
        if found is None:
            sizes[id(value)] = 1
            continue
        open_values.add(id(value))
        parts[id(value)] = found
        pending.append((value, owner, True))
        part_owner = value if isinstance(value, ConfigValues) else owner
        pending.extend((part, part_owner, False) for part in found)
    return sizes[id(tree)]


def _parts(tree: ConfigTree, value: Any, owner: ConfigValues | None, open_values: set[int]) -> list[Any] | None:
    """What ``value`` is made of once resolved, for `expanded_size`; None for a scalar (one value)."""
    if isinstance(value, ConfigTree):
        return list(value.values())
    if isinstance(value, list):
        return value
    if isinstance(value, ConfigValues):
        return list(value.tokens)
    if isinstance(value, ConfigSubstitution):
        target = _lookup(tree, ConfigTree.parse_key(value.variable))
        if id(target) in open_values:  # refers to itself: to the value it overrides
            target = owner.overridden_value if owner is not None else None
        if target is _MISSING or target is None or id(target) in open_values:
            return None  # the environment, a string, or a cycle pyhocon reports
        return [target]
    return None


class _DocumentOnlyParser(ConfigParser):
    """pyhocon's resolution, without its fallback on ``os.environ`` (it keeps no state: thread-safe)."""

    @classmethod
    def _resolve_variable(cls, config: ConfigTree, substitution: ConfigSubstitution) -> tuple[bool, Any]:
        try:
            return True, config.get(substitution.variable)
        except ConfigMissingException:
            if substitution.optional:
                return False, None
            where = ""
            if isinstance(substitution.instring, str):
                line = lineno(substitution.loc, substitution.instring)
                where = f" (line: {line}, col: {col(substitution.loc, substitution.instring)})"
            raise ConfigSubstitutionException(f"Cannot resolve variable ${{{substitution.variable}}}{where}") from None


def _environment_reason(tree: ConfigTree, key_path: KeyPath, substitution: ConfigSubstitution) -> str | None:
    """Say why pyhocon would read ``substitution`` from the environment ("missing", "null"), or None."""
    parts = ConfigTree.parse_key(substitution.variable)
    target = _lookup(tree, parts)
    if target is _MISSING:
        return "missing"
    if _may_be_null(tree, target, set()):
        return "null"
    # `k = ${?k} x` (and `k += x`) with no earlier `k`: pyhocon looks `k` up in the environment.
    own_key = key_path[0] if key_path else None
    if parts == [own_key] and len(tree.history.get(own_key, ())) <= 1:
        return "missing"
    return None


def _lookup(tree: ConfigTree, parts: list[str]) -> Any:
    """The value at ``parts`` through objects only, as pyhocon's first look finds it, or `_MISSING`."""
    node: Any = tree
    for part in parts:
        if not isinstance(node, ConfigTree):
            return _MISSING  # through a list, a scalar or an unresolved value: not found as written
        node = dict.get(node, part, _MISSING)
        if node is _MISSING:
            return _MISSING
    return node


def _may_be_null(tree: ConfigTree, value: Any, seen: set[int]) -> bool:
    """Whether ``value`` is null or resolves to null (pyhocon then deletes the key bound to it)."""
    if value is None or isinstance(value, NoneValue):
        return True
    if not isinstance(value, ConfigValues) or id(value) in seen:
        return False  # a cycle is pyhocon's to report
    seen.add(id(value))
    if not value.tokens or not all(isinstance(token, ConfigSubstitution) for token in value.tokens):
        return False  # any text or object in it survives the substitutions
    targets = [_lookup(tree, ConfigTree.parse_key(token.variable)) for token in value.tokens]
    return all(target is _MISSING or _may_be_null(tree, target, seen) for target in targets)


def _substitutions(tree: ConfigTree) -> Iterator[tuple[KeyPath, ConfigSubstitution]]:
    """Yield every substitution of the tree once, with the key path it is written at.

    Values that a later one overrode are walked too (pyhocon may still resolve them), and so is
    the history pyhocon keeps of each top-level key.
    """
    seen: set[int] = set()
    pending: deque[tuple[KeyPath, Any]] = deque([((), tree)])
    pending += [((key,), item) for key, items in tree.history.items() for item in items]
    while pending:
        key_path, value = pending.popleft()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, ConfigSubstitution):
            yield key_path, value
        elif isinstance(value, ConfigValues):
            pending.extendleft(reversed([(key_path, token) for token in value.tokens]))
            if value.overridden_value is not None:
                pending.append((key_path, value.overridden_value))
        elif isinstance(value, ConfigTree):
            pending.extendleft(reversed([((*key_path, key), item) for key, item in value.items()]))
        elif isinstance(value, list):
            pending.extendleft(reversed([((*key_path, index), item) for index, item in enumerate(value)]))
