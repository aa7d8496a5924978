"""The args a component accepts: its signature, with ``**kwargs`` followed up to its parent's.

A subclass that adds a few args and hands the rest to its parent::

    class FedOpt(FedAvg):
        def __init__(self, server_lr: float = 0.01, **kwargs: Any) -> None:
            super().__init__(**kwargs)

accepts ``server_lr`` and every arg of ``FedAvg.__init__``, and `accepted_args` says so, so a
config's args are checked (names, required ones, types) against all of them and a typo still gets
a suggestion. ``**kwargs`` is followed only where the source shows it goes up whole: the
``__init__`` uses its ``**kwargs`` once, in one ``super().__init__(..., **kwargs)`` call. The args
that call passes itself (by name, or the first ones by position) are the parent's but not the
subclass's. Anything else (a ``**kwargs`` that is read, changed or passed elsewhere, a factory
function, code whose source cannot be read) accepts any name, as before: the constructor checks
its own args.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from dataclasses import dataclass, field
from typing import Any

_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclass
class AcceptedArgs:
    """What a component's constructor accepts by keyword.

    Attributes:
        parameters: Name -> parameter, the class's own first, then each parent's that its
            ``**kwargs`` reaches (a default or a required arg is the one of its owner).
        hints: Name -> type annotation, where one resolves.
        takes_any: Whether any other name is accepted too (a ``**kwargs`` that is not followed).
    """

    parameters: dict[str, inspect.Parameter] = field(default_factory=dict)
    hints: dict[str, Any] = field(default_factory=dict)
    takes_any: bool = False


def accepted_args(target: Any) -> AcceptedArgs | None:
    """The keyword args ``target`` (a class or a factory) accepts; None when it has no signature.

    Example:
        >>> args = accepted_args(engine.workflows.FedOpt)
        >>> "num_rounds" in args.parameters, "server_lr" in args.parameters, args.takes_any
        (True, True, False)
    """
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None  # some builtins have no signature; the constructor will check its own args
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    if inspect.isclass(target) and takes_kwargs:
        followed = _follow_init_chain(target)
        if followed is not None:
            return followed
    named = {name: p for name, p in signature.parameters.items() if p.kind in _NAMED}
    return AcceptedArgs(named, _type_hints(target.__init__ if inspect.isclass(target) else target), takes_kwargs)


def _follow_init_chain(cls: type) -> AcceptedArgs | None:
    """The args of ``cls.__init__`` and of the parents its ``**kwargs`` reaches.

    None when the class's signature is not an ``__init__``'s (a ``__new__``, a metaclass).
    """
    accepted = AcceptedArgs()
    passed_by_name: set[str] = set()
    passed_by_position = 0
    mro = cls.__mro__
    index = 0
    first = True
    while True:
        index = next(i for i in range(index, len(mro)) if "__init__" in vars(mro[i]))
        owner = mro[index]
        if owner is object:  # object.__init__ takes nothing more
            return accepted
        init = vars(owner)["__init__"]
        try:
            params = list(inspect.signature(init).parameters.values())[1:]  # without self
        except (TypeError, ValueError):
            accepted.takes_any = True
            return accepted
        var_keyword = next((p for p in params if p.kind is p.VAR_KEYWORD), None)
        if first and var_keyword is None:
            return None  # the class's signature comes from elsewhere (__new__, a metaclass)
        first = False
        hints = _type_hints(init)
        given = {p.name for p in [p for p in params if p.kind in _POSITIONAL][:passed_by_position]} | passed_by_name
        for param in params:
            if param.kind in _NAMED and param.name not in given and param.name not in accepted.parameters:
                accepted.parameters[param.name] = param
                if param.name in hints:
                    accepted.hints[param.name] = hints[param.name]
        if var_keyword is None:
            return accepted
        call = _kwargs_passed_up(init, var_keyword.name)
        if call is None:
            accepted.takes_any = True
            return accepted
        names, positional = call
        passed_by_name |= names
        passed_by_position = positional
        index += 1


def _kwargs_passed_up(init: Any, kwargs_name: str) -> tuple[set[str], int] | None:
    """The args the one ``super().__init__(..., **kwargs_name)`` call passes itself: ``(names, how many by position)``.

    None unless that call is the only use of ``kwargs_name`` in ``init``'s source.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    except (OSError, TypeError, SyntaxError):
        return None
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == kwargs_name]
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "__init__"
        and isinstance(n.func.value, ast.Call)
        and isinstance(n.func.value.func, ast.Name)
        and n.func.value.func.id == "super"
        and any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id == kwargs_name for k in n.keywords)
    ]
    if len(uses) != 1 or len(calls) != 1:
        return None  # read, changed or passed elsewhere too: any name may be meant
    call = calls[0]
    if any(isinstance(arg, ast.Starred) for arg in call.args) or sum(k.arg is None for k in call.keywords) != 1:
        return None
    return {k.arg for k in call.keywords if k.arg is not None}, len(call.args)


def _type_hints(function: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(function)
    except Exception:  # noqa: BLE001 - unresolvable annotations only mean we check fewer types
        return {}
