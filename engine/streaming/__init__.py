"""Streaming: moving tensors between cells as pulled chunks of one safetensors byte stream.

Plain classes without sockets: `layout` (the stream's bytes, served without copies; checking a
received header), `downloadable` (tensors served as that stream, GPU/non-contiguous ones copied
one at a time), `transactions` (ref ids, receivers, deadlines, freeing) and `consumers` (chunks
placed into preallocated tensors, or written to a ``.safetensors`` file). On cells: `service`
(the sender's handlers and the receiver's pipelined pull) and `via_downloader` (FOBS decomposers
that send a message's tensors and arrays by download, installed with `install_via_downloader`).
"""
