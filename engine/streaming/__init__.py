"""Streaming: moving tensors between cells as pulled chunks of one safetensors byte stream.

So far, all plain classes without sockets: `layout` (the stream's bytes, served without copies;
checking a received header), `downloadable` (tensors served as that stream, GPU/non-contiguous
ones copied one at a time), `transactions` (ref ids, receivers, deadlines, freeing) and
`consumers` (chunks placed into preallocated tensors, or written to a ``.safetensors`` file).
The download service that runs them over cells comes with the cells layer.
"""
