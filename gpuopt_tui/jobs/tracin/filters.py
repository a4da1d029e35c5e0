"""Which (test, train) pairs are scored in batch mode.

A filter gives every example a few integer keys; a training example is scored against a test example when
they share a key. Sharing a label (keys: the label) and sharing an entity of a knowledge-graph triple (keys:
the head and tail entity ids) are both this one rule, so a new predicate is one more `PairFilter`.
Training examples that match no test example are not scored at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from gpuopt_tui.core.errors import UserError


@dataclass(frozen=True)
class PairFilter:
    name: str
    field: str  # the batch tensor the keys come from
    keys: Callable[[Tensor], Tensor]  # that tensor [N, ...] -> keys [N, K]; negative keys match nothing

    def example_keys(self, tensors: Mapping[str, Tensor], what: str) -> Tensor:
        if self.field not in tensors:
            raise UserError(f'filter = {self.name} needs "{self.field}" on the {what} examples, which have none')
        return self.keys(tensors[self.field]).long()

    def mask(self, test_keys: Tensor, train_keys: Tensor) -> Tensor:
        """[n_test, n_train] True where the pair shares a key."""
        out = torch.zeros(test_keys.shape[0], train_keys.shape[0], dtype=torch.bool)
        for i in range(test_keys.shape[1]):
            t = test_keys[:, i, None]
            for j in range(train_keys.shape[1]):
                out |= (t == train_keys[None, :, j]) & (t >= 0)
        return out


FILTERS: dict[str, PairFilter] = {
    f.name: f
    for f in (
        PairFilter("same_label", "labels", lambda labels: labels.reshape(-1, 1)),
        # Knowledge-graph adapters put the entity ids of each triple (head, tail) in "entity_ids" [N, 2].
        PairFilter("shared_entity", "entity_ids", lambda ids: ids.reshape(ids.shape[0], -1)),
    )
}


def get_filter(name: str) -> PairFilter | None:
    """The filter called `name`; None for "none"."""
    if name == "none":
        return None
    if name not in FILTERS:
        raise UserError(f"filter must be one of none, {', '.join(FILTERS)}; got {name!r}")
    return FILTERS[name]
