"""Which slice of the model this process runs: its ranks and process groups."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class ParallelState:
    """This process's place in the tensor-parallel × pipeline-parallel grid."""

    tp_rank: int = 0
    """Rank inside the tensor-parallel group."""
    tp_size: int = 1
    """Size of the tensor-parallel group."""
    pp_rank: int = 0
    """Pipeline stage of this process."""
    pp_size: int = 1
    """Number of pipeline stages."""
    tp_group: Any = None
    """The torch.distributed group for tensor-parallel collectives (None when ``tp_size == 1``)."""
    pp_group: Any = None
    """The torch.distributed group linking pipeline stages (None when ``pp_size == 1``)."""

    @property
    def world_size(self) -> int:
        """Processes in the whole grid."""
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        """This stage embeds tokens."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This stage produces logits."""
        return self.pp_rank == self.pp_size - 1
