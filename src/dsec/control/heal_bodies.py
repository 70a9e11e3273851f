"""Request bodies of the healing routes (control/heal_routes.py): what a member or a supervisor may send, with the
bounds that keep it storable (epochs and counts end up in JSON event data)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from dsec.control.schemas import Int, json_integer

RUN_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
INCARNATION_PATTERN = r"^[A-Za-z0-9._:-]{1,64}$"
ADDRESS_PATTERN = r"^[A-Za-z0-9._:\[\]-]{1,255}:[0-9]{1,5}$"
MAX_WORLD = 65536

# Optional integers carry their bounds inside (see schemas.SnapshotLevel for why).
OptRank = Annotated[int, Field(strict=True, ge=0, lt=MAX_WORLD), BeforeValidator(json_integer)] | None


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("rank", "dead_rank", check_fields=False)
    @classmethod
    def _rank_in_world(cls, rank: int | None, info: ValidationInfo) -> int | None:
        """A rank the same body's world cannot hold (``world`` is declared first, so it is validated already)."""
        world = info.data.get("world")
        if rank is not None and world is not None and rank >= world:
            raise ValueError(f"{info.field_name}={rank} is out of range for world={world}: expected < world")
        return rank


class JoinBody(_Body):
    """``rank`` < ``world`` (422 naming rank); a world other than the run's is a 409 naming world."""

    pool: str = Field(..., min_length=1, max_length=128)
    group: str = Field("default", min_length=1, max_length=128)
    world: Int = Field(..., ge=1, le=MAX_WORLD)
    rank: Int = Field(..., ge=0, lt=MAX_WORLD, description="< world")
    incarnation: str = Field(..., pattern=INCARNATION_PATTERN)
    address: str = Field(..., pattern=ADDRESS_PATTERN)
    completed: Int = Field(0, ge=0, le=2**53)  # bounded: they are stored in event data (JSON, 64-bit at most)
    epoch: Int = Field(0, ge=0, le=2**53)
    view: list[Annotated[int, Field(strict=True, ge=0, lt=MAX_WORLD), BeforeValidator(json_integer)]] = Field(
        default_factory=list, max_length=MAX_WORLD
    )
    replacement: bool = False
    device: str | None = Field(None, max_length=128)
    pending: str | None = Field(None, max_length=200)


class AdmitBody(_Body):
    rank: Int = Field(..., ge=0, lt=MAX_WORLD)
    incarnation: str = Field(..., pattern=INCARNATION_PATTERN)
    epoch: Int = Field(..., ge=1, le=2**53)
    completed: Int = Field(..., ge=0, le=2**53)


class FailBody(_Body):
    """With ``world``, ``rank`` and ``dead_rank`` are < world (422); a dead_rank the run's world cannot hold: 409."""

    # declared first: the rank checks read it
    world: Annotated[int, Field(strict=True, ge=1, le=MAX_WORLD), BeforeValidator(json_integer)] | None = None
    # None: the current one (a supervisor does not know epochs)
    epoch: Annotated[int, Field(strict=True, ge=0, le=2**53), BeforeValidator(json_integer)] | None = None
    rank: OptRank = None  # the reporter, when it is a member
    incarnation: str | None = Field(None, pattern=INCARNATION_PATTERN)
    dead_rank: OptRank = None
    dead_incarnation: str | None = Field(None, pattern=INCARNATION_PATTERN)
    # the exited process (a supervisor knows its pid)
    dead_pid: Annotated[int, Field(strict=True, ge=1, le=2**31), BeforeValidator(json_integer)] | None = None
    reason: str = Field("", max_length=500)
    pool: str | None = Field(None, min_length=1, max_length=128)


class LeaveBody(_Body):
    rank: Int = Field(..., ge=0, lt=MAX_WORLD)
    incarnation: str = Field(..., pattern=INCARNATION_PATTERN)
