"""Streaming: moving tensors between cells as pulled chunks of one safetensors byte stream.

So far: `layout` (the stream's bytes, served without copies; checking a received header) and
`consumers` (chunks placed into preallocated tensors, or written to a ``.safetensors`` file).
"""
