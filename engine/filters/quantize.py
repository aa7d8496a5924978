"""`Quantize`: a model's float params cross the network in fp16, bf16 or 8-bit blocks."""

from __future__ import annotations

import logging

from engine.filters.filter import Filter
from engine.fobs.quantized import CODECS, MODES
from engine.model import Shareable
from engine.model.quantize import quantized_copy

log = logging.getLogger(__name__)


class Quantize(Filter):
    """Sends the params of a task or a result quantized; the receiver gets float values back.

    Put it where a model leaves: the server's ``task_data_filters`` (the global model to the
    sites) and the clients' ``task_result_filters`` (their updates to the server). Nothing is
    needed where the model arrives: the receiver decodes each chunk as it lands, into the model
    it was going to fill (memory, disk with ``download_to_disk``, the server's running sum), so
    no process holds a second copy of the model, and a result is checked (finite, within its
    bounds) on the decoded values as any other. Only streamed tensors are quantized (a chunk size
    of 0 sends everything exactly).

    Bytes on the wire and error (relative to the largest magnitude of a tensor, or of a block of
    4,092 values for int8 and 8,184 for int4):

    ========  ============  =====================================
    mode      bytes/value   error
    ========  ============  =====================================
    ``fp16``  2             2**-11; values beyond +-65504 refused
    ``bf16``  2             2**-8; float32's range
    ``int8``  ~1.001        1/254 of the block's largest value
    ``int4``  ~0.5005       1/14 of the block's largest value
    ========  ============  =====================================

    Args:
        mode: ``"fp16"``, ``"bf16"``, ``"int8"`` or ``"int4"``.
        min_numel: Tensors with fewer values travel exactly (biases and norms cost little).

    Example:
        In ``config_fed_client.conf`` (and the same under ``task_data_filters`` of
        ``config_fed_server.conf``)::

            task_result_filters = [
              { tasks = [train], filters = [
                { path = engine.filters.Quantize, args { mode = int8 } } ] }
            ]
    """

    same_for_every_site = True  # the server quantizes a task once for all its clients

    def __init__(self, mode: str = "int8", min_numel: int = 0) -> None:
        if mode not in CODECS:
            raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
        if type(min_numel) is not int or min_numel < 0:
            raise ValueError(f"min_numel: expected an integer >= 0, got {min_numel!r}")
        self.mode = mode
        self.min_numel = min_numel

    def process(self, shareable: Shareable, site: str) -> Shareable:
        """Return a copy of ``shareable`` whose float params travel quantized (``shareable`` unchanged)."""
        quantized = quantized_copy(shareable, self.mode, self.min_numel)
        log.debug("params quantized: site=%s mode=%s", site, self.mode)
        return quantized
