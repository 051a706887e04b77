"""Last-token pooling: an embedding engine's replacement for the sampler.

The decoder's output is already the final hidden state after the final norm, so the
embedding of a request is its row at the prompt's last token (engine/pooling.py says why
that is the pooling we run), in float32, cut to the request's `dimensions` and then
L2-normalised when the model normalises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.pooling import PoolerConfig
from engine.request import Request


class LastTokenPooler:
    def __init__(self, config: PoolerConfig) -> None:
        self.normalize = config.normalize

    def __call__(self, last: torch.Tensor, requests: list[Request]) -> dict[str, list[float]]:
        """`last`: (len(requests), hidden_size), each request's last-token hidden state.
        Returns each request's embedding by id."""
        vectors = last.float()  # (n, hidden_size)
        if self.normalize:
            vectors = F.normalize(vectors, dim=-1)
        embeddings = {}
        for request, vector in zip(requests, vectors, strict=True):
            assert request.pooling_params is not None, "the core admits embedding requests only"
            size = request.pooling_params.dimensions
            if size is not None:
                vector = vector[:size]  # Matryoshka: the first `size` dimensions
                if self.normalize:
                    vector = F.normalize(vector, dim=0)
            embeddings[request.request_id] = vector.tolist()
        return embeddings
