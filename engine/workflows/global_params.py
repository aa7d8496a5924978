"""`RoundModelParams`: the weights a round's clients were sent, read back from the persistor when first asked for.

The round loop hands the global model's params over to the round's task, so the server holds no
weights while the clients train (`RoundLoop.task_data`). `RoundLoop.update_global` still gets
those weights as ``model.params``: this mapping, which reads them from the persistor on first use
(`ModelPersistor.global_params_for_reading`: references into the saved checkpoint, read a block
at a time, with `PTFileModelPersistor`; the loaded model with other persistors) and nothing at all
when the algorithm does not look (FedAvg's FULL mean).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any


class RoundModelParams(Mapping[str, Any]):
    """Name -> value of the model a round started from, read with ``read()`` on first access.

    Values may be lazy references into a file (``shape``, ``dtype``, ``read_elements``); turn
    one into a tensor with `engine.aggregators.resolve_value`.

    Args:
        read: Returns the params (the persistor's ``global_params_for_reading``); called once.

    Example:
        >>> params = RoundModelParams(lambda: {"w": torch.zeros(2)})
        >>> params["w"]
        tensor([0., 0.])
    """

    def __init__(self, read: Callable[[], Mapping[str, Any]]) -> None:
        self._read: Callable[[], Mapping[str, Any]] | None = read
        self._params: Mapping[str, Any] = {}

    @property
    def is_read(self) -> bool:
        """Whether the params were read (something asked for them)."""
        return self._read is None

    def _loaded(self) -> Mapping[str, Any]:
        if self._read is not None:
            self._params, self._read = self._read(), None
        return self._params

    def __getitem__(self, name: str) -> Any:
        return self._loaded()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaded())

    def __len__(self) -> int:
        return len(self._loaded())

    def __repr__(self) -> str:
        return f"RoundModelParams({len(self._params)} params)" if self.is_read else "RoundModelParams(not read yet)"
