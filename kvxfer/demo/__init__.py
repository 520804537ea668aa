"""Small demo models used to exercise the KV-transfer machinery.

`kvxfer.demo.model` holds a tiny Llama-style decoder with a paged KV cache
whose per-page computations are bit-reproducible, so KV blocks computed in
one request can be cached, moved between tiers and reused by another.
"""
