"""`FoldedResults`: how `RoundLoop` folds a result as its tensors arrive, and rebuilds a sum a result tainted.

A result whose every param streams as a torch tensor is folded into the round's sum chunk by
chunk (`engine.aggregators.folding`): its header is checked when it is opened (weight, type, a
second result), its layout when the stream announces it, each tensor once complete. A refusal
midway is the site's; the sum is then rebuilt without it (the other results are pulled again from
their senders, which hold them until the round's mean is made), and that site's results are taken
whole from then on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from engine.aggregators.folding import FoldingModelAggregator, ResultFold
from engine.aggregators.refusals import record_refusal
from engine.model import FLModel, ReservedHeaderKey, ReturnCode, Shareable, model_from_shareable
from engine.workflows.background_save import BackgroundSave

log = logging.getLogger("engine.workflows.round_loop")  # the round loop's log lines, named as before


class FoldedResults:
    """The folding part of `RoundLoop`; the attributes it reads are `RoundLoop`'s."""

    def _rebuild(self, aggregator: FoldingModelAggregator, accepted: list[str], current_round: int) -> None:
        """Make the round's sum again without the results that failed midway; drop the ones it could not redo."""
        tainted = aggregator.tainted()
        started = time.monotonic()
        left_out = aggregator.rebuild(self.abort_signal)
        # Sites refused by the checks after part of their result was folded (a NaN in a later
        # tensor) are received whole from then on; a site that died or was cut off is not: a
        # result taken whole cannot be folded again, so it would be lost at every later rebuild
        # (a straggler cut off by the round's end twice would lose results for good).
        self._whole_from.update(site for site in (*tainted, *left_out) if site in self.refused)
        for client, why in left_out.items():
            if client in accepted:
                accepted.remove(client)
            self.failures[client] = why
        log.warning(
            "round %d: sum rebuilt without partly folded results: failed=%s left_out=%s seconds=%.2f",
            current_round + 1,
            sorted(tainted),
            sorted(left_out),
            time.monotonic() - started,
        )
        self.context.report("round_rebuilt", round=current_round, failed=dict(tainted), left_out=dict(left_out))

    def _receive(
        self,
        aggregator: FoldingModelAggregator,
        reference: dict[str, Any],
        saving: BackgroundSave,
        current_round: int,
        header: Shareable,
        client: str,
    ) -> ResultFold | None:
        """Open the fold of a result whose tensors are still to come (its header alone), or None to take it whole.

        Only a FULL/DIFF model whose every param streams as a torch tensor is folded; its header
        is checked here (weight, type, a second result), its layout when the stream announces it,
        each tensor once complete (`check_result` on placeholders, then the values' rules). A
        refusal is recorded as the site's (``refused``) and fails the download. A site whose
        result was once refused midway (the sum had to be rebuilt) is received whole from then on.
        """
        if header.get_return_code() is not ReturnCode.OK or client in self._whole_from:
            return None
        result_round = header.get_header(ReservedHeaderKey.CURRENT_ROUND)
        if result_round is not None and result_round != current_round:
            return None  # refused on arrival, as a whole result is
        try:
            model = model_from_shareable(header)
        except ValueError:
            return None
        params = model.params or {}
        if not params or not all(getattr(v, "is_tensor", False) for v in params.values()):
            return None  # inline values, arrays (quantized ones too), nothing to fold: received whole
        items = {str(value.item): name for name, value in params.items()}
        if len(items) != len(params):
            return None
        saving.join()  # the old weights are gone before results pile up (as in `_accept`)

        def check_layout(placeholders: dict[str, Any]) -> None:
            self._refusing(
                client,
                current_round,
                self.check_result,
                _with_params(model, placeholders),
                client,
                current_round,
                reference,
            )

        def check_tensor(name: str, tensor: Any) -> None:
            self._refusing(client, current_round, self.rules.check_values, {name: tensor}, client)

        return self._refusing(
            client, current_round, aggregator.open_result, model, client, items, check_layout, check_tensor
        )

    def _refusing(self, client: str, current_round: int, check: Callable[..., Any], *args: Any) -> Any:
        """``check(*args)``; what it raises is recorded (`record_refusal`: a refusal, or a bug) and raised again."""
        try:
            return check(*args)
        except Exception as e:
            # The result's download fails with it; the server's result intake logs a bug's traceback.
            record_refusal(e, client, current_round, self.failures, self.refused, with_traceback=False)
            raise

    def _global_params(self, model: FLModel) -> dict[str, Any]:
        """The global model the clients were sent this round: held here, else read from the persistor on demand."""
        if model.params is not None:
            return dict(model.params)
        return dict(self.persistor.global_params_for_reading())


def _with_params(model: FLModel, params: dict[str, Any]) -> FLModel:
    """``model``'s header with ``params`` (placeholders) and no metrics (those are checked with the whole result)."""
    return FLModel(
        params=params,
        params_type=model.params_type,
        meta=dict(model.meta or {}),
        current_round=model.current_round,
        total_rounds=model.total_rounds,
    )
