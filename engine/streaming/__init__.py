"""Streaming: moving tensors (or files) between cells as pulled chunks of one byte stream.

Plain classes without sockets: `layout` (the stream's bytes, served without copies; checking a
received header), `downloadable` (tensors served as that stream, GPU/non-contiguous ones copied
one at a time; or a file's bytes), `transactions` (ref ids, receivers, deadlines, freeing) and
`consumers` (chunks placed into preallocated tensors, or written to a file). On cells: `service`
(the sender's handlers and the receiver's pipelined pull), `via_downloader` (FOBS decomposers
that send a message's tensors and arrays by download, installed with `install_via_downloader`,
and the `StreamingContext` they read, built from a job config with `from_config`) and
`via_file` (`ViaFileDecomposer`, the base of decomposers whose objects travel as a file).
"""
