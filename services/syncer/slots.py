"""One fragment's state on the syncer, and its open merge round.

Owns `FragmentSlot` (the global values and outer optimizer state of one fragment, the versions
learners may still base contributions on, what learners hold, the caches of its encodings, its
lock and grace timer) and `Round` (the streaming accumulator of the contributions to its next
version), plus the two ways a slot changes version: `advance` (a merge) and `reset` (a restore); and
`Slots`, every planned fragment's slot with which of them this syncer owns (fragment shards),
built by `build_slots` with each fragment's outer optimizer (`outer_steppers`).
Must not: decide when to merge, validate uploads or encode; the core does that under `lock`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import weakref
from typing import NamedTuple

import numpy as np

from ddiloco.algo import fragments as fragments_lib
from ddiloco.algo import merge as merge_lib
from ddiloco.algo import outer as outer_lib
from ddiloco.algo import robust as robust_lib
from ddiloco.algo import shards as shards_lib
from ddiloco.rpc import errors
from ddiloco.wire import codec as codec_lib
from . import versions as versions_lib


@dataclasses.dataclass
class Round:
    """The open merge round of one fragment: an accumulator plus small per-contribution records."""

    accumulator: merge_lib.MergeAccumulator
    opened_at_s: float
    quorum_reached_at_s: float | None = None
    contributions: list = dataclasses.field(default_factory=list)  # merging.Contribution, in the order folded in
    learners: set = dataclasses.field(default_factory=set)
    # Opened by the schedule (its learners were called); before that, early contributions only
    # gather. The round number is the slot's count of rounds opened.
    open: bool = False
    number: int = 0
    # One dict per contribution folded in: claims, credited steps, weights, norms, what was clipped
    # (Admission.accepted); the merge's influence record and ledger line (services/syncer/influence.py).
    influence: list = dataclasses.field(default_factory=list)
    # Accountability (influence.fold_record): each fold-in's inputs in the accumulator's order, and
    # the merge's own inputs (rules, caps, outer step), so that `ddiloco audit replay` can redo it.
    folds: list = dataclasses.field(default_factory=list)
    merge_inputs: dict | None = None


class FragmentStatus(NamedTuple):
    """One fragment's row of the training state now (FragmentSlot.status; wire_views.fragment_state)."""

    fragment_id: int
    version: int
    numel: int
    pending_contributions: int  # folded into the open round
    params_sha256: str
    published_sha256: str
    round: int  # rounds opened so far
    round_open: bool


@dataclasses.dataclass
class FragmentSlot:
    fragment: fragments_lib.Fragment
    version: int
    params: np.ndarray
    opt_state: list
    # version -> what a contribution based on it is re-anchored from (current included): the
    # published values, or for earlier versions with a lossy download codec the steps from them.
    history: versions_lib.VersionHistory
    params_sha256: str
    # What learners hold for the current version: `params` itself when downloads are lossless;
    # with a lossy download codec, the reconstruction learners compute from the deltas sent so
    # far (the quantization error is carried into the next delta, error feedback).
    published: np.ndarray | None = None
    published_sha256: str = ""
    # (version, encoding of published[version] - published[version - 1]) for lossy downloads.
    delta_encoded: tuple[int, codec_lib.EncodedPayload] | None = None
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    round: Round | None = None
    # The current published values as exact float32 (Publisher.encoded_payload); see `encoded`.
    encoded_ref: codec_lib.EncodedPayload | weakref.ref | None = None
    # (version, the encode in progress): watchers asking at once share one encode.
    encoding: tuple[int, asyncio.Future] | None = None
    timer: asyncio.TimerHandle | None = None
    merging: bool = False  # a merge task is scheduled or running
    norms: robust_lib.NormHistory | None = None  # recent accepted contributions (norm bound)
    # The last merged outer gradient in factored form (the round's sums x per-tensor scales, never
    # written out) and its norm: the cosine's reference for direction agreement.
    last_outer_grad: tuple[merge_lib.ScaledResult, float] | None = None
    # (params_sha256, norm of params): the norm bound's reference, computed once per version, not
    # once per upload (a float64 pass over the fragment under its lock).
    params_norm: tuple[str, float] | None = None
    rounds_opened: int = 0
    # The latest merge's broadcast: (version, merge start, learners it has not reached yet); sync
    # time (grace window input) is measured when the last of them was sent the version.
    broadcast: tuple[int, float, set] | None = None
    # The newest version a committed checkpoint holds (a restored version counts): with
    # --commit-before-broadcast no later version is sent (commit_gate.py).
    committed_version: int = 0

    @property
    def encoded(self) -> codec_lib.EncodedPayload | None:
        """The current version's exact float32 encoding, if cached. Held while it is a view of
        `published` (no bytes of its own); a zstd-compressed copy (~4 bytes per value) only while
        a watch stream or the merge that made it holds it: kept until the next merge, it was one
        more copy of the fragment at a shard's peak, for the rare whole downloads."""
        ref = self.encoded_ref
        return ref() if isinstance(ref, weakref.ref) else ref

    @encoded.setter
    def encoded(self, value: codec_lib.EncodedPayload | None) -> None:
        held = value is None or isinstance(value.payload, memoryview)
        self.encoded_ref = value if held else weakref.ref(value)

    @classmethod
    def initial(cls, fragment: fragments_lib.Fragment, initial_params: np.ndarray, stepper: outer_lib.OuterStepper,
                norm_bound: robust_lib.NormBoundPolicy) -> FragmentSlot:
        """Version 0 of a fragment: a float32 copy of `initial_params` are its values and what
        learners hold; `stepper` (the fragment's outer optimizer) gives its initial state."""
        params = np.asarray(initial_params, dtype=np.float32).copy()
        digest = fragments_lib.fragment_sha256(params)
        return cls(fragment=fragment, version=0, params=params, opt_state=stepper.init(params),
                   history=versions_lib.VersionHistory(0, params), params_sha256=digest, published=params,
                   published_sha256=digest, norms=robust_lib.NormHistory(norm_bound, fragment))

    @classmethod
    def elsewhere(cls, fragment: fragments_lib.Fragment) -> FragmentSlot:
        """A fragment another syncer shard owns: no values, no optimizer state, never a round (the
        shard refuses its uploads and serves it nowhere; its owner does). Kept so that fragment ids
        still index the slots."""
        return cls(fragment=fragment, version=0, params=np.empty(0, np.float32), opt_state=[],
                   history=versions_lib.VersionHistory(), params_sha256="")

    def advance(self, params: np.ndarray, opt_state: list, published: np.ndarray, keep_versions: int) -> None:
        """The next version (a merge): new values and optimizer state, what learners will hold of
        it, at most `keep_versions` versions kept to base contributions on (earlier ones as the
        delta encodings learners applied, when the Publisher cached this version's); the round is
        done."""
        self.params, self.opt_state = params, opt_state
        self.version += 1
        self.published = published
        step = self.delta_encoded[1] if self.delta_encoded is not None and self.delta_encoded[0] == self.version else None
        self.history.advance(self.version, published, keep_versions, step)
        self.params_sha256 = fragments_lib.fragment_sha256(params)
        self.published_sha256 = (self.params_sha256 if published is params
                                 else fragments_lib.fragment_sha256(published))
        self.encoded = None
        self.round = None

    def reset(self, params: np.ndarray, opt_state: list, version: int, digest: str) -> None:
        """Restored values (a restart): a new instance, so every learner re-downloads exact
        values and what they hold restarts from the parameters themselves."""
        self.params = params
        self.opt_state = opt_state
        self.version = version
        self.published, self.published_sha256, self.delta_encoded = params, digest, None
        self.history = versions_lib.VersionHistory(version, params)
        self.params_sha256 = digest
        self.encoded = None
        self.round = None

    def status(self) -> FragmentStatus:
        return FragmentStatus(
            fragment_id=self.fragment.fragment_id, version=self.version, numel=self.fragment.numel,
            pending_contributions=len(self.round.contributions) if self.round else 0,
            params_sha256=self.params_sha256, published_sha256=self.published_sha256, round=self.rounds_opened,
            round_open=bool(self.round is not None and self.round.open))

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Slots(list):
    """One FragmentSlot per planned fragment, indexed by fragment id (a list, as the parts read it),
    and which of them this syncer owns: with fragment shards, another shard's fragment is an empty
    `elsewhere` slot, and rounds, watch streams, the training state and checkpoints cover `owned_slots`."""

    def __init__(self, slots: list[FragmentSlot], layout: shards_lib.ShardLayout) -> None:
        super().__init__(slots)
        self.layout = layout
        self.owned: frozenset[int] = frozenset(layout.owned)
        self.owned_slots: list[FragmentSlot] = [slot for slot in slots if slot.fragment.fragment_id in self.owned]

    def versions(self) -> dict[int, int]:
        """The version of each fragment this syncer (shard) owns."""
        return {s.fragment.fragment_id: s.version for s in self.owned_slots}

    def digest(self, fragment_id: int) -> tuple[int, str, str]:
        """(version, published_sha256, params_sha256) of a fragment now."""
        s = self[fragment_id]
        return s.version, s.published_sha256, s.params_sha256

    def require_owned(self, fragment_id: int) -> None:
        """FAILED_PRECONDITION naming the owner when another shard owns the fragment."""
        if fragment_id not in self.owned and 0 <= fragment_id < len(self):
            owner = self.layout.owner_of(fragment_id)
            raise errors.FailedPrecondition(
                f"fragment {fragment_id} belongs to syncer shard {owner} ({'|'.join(self.layout.addresses[owner])}), "
                f"this is {self.layout.describe()}: send it there (JoinResponse.shards)", reason="not_owner")


def outer_steppers(plan: fragments_lib.FragmentPlan, outer_lr: float, outer_momentum: float,
                   stepper_factory=None) -> list[outer_lib.OuterStepper]:
    """Each fragment's outer optimizer: `stepper_factory(fragment)`'s, or one Nesterov SGD shared by all."""
    if stepper_factory is None:
        shared = outer_lib.OuterStepper(outer_lib.make_outer_optimizer(outer_lr, outer_momentum))
        return [shared for _ in plan.fragments]
    return [stepper_factory(frag) for frag in plan.fragments]


def build_slots(plan: fragments_lib.FragmentPlan, layout: shards_lib.ShardLayout | None, initial_params,
                steppers: list, norm_bound: robust_lib.NormBoundPolicy) -> Slots:
    """One slot per planned fragment: version 0 of each fragment the layout gives this syncer (its
    values from `initial_params`, a mapping that needs no others), an empty `elsewhere` slot for
    each other shard's. A shard of N thus holds about 1/N of the model's bytes. No layout: one
    syncer owns every fragment."""
    # Fragment shards: every shard plans all P fragments (the same RunConfig) and owns some of them.
    layout = layout or shards_lib.ShardLayout(num_fragments=plan.num_fragments)
    if layout.num_fragments != plan.num_fragments:
        raise ValueError(f"the shard layout is for {layout.num_fragments} fragments, the plan has {plan.num_fragments}")
    owned = frozenset(layout.owned)
    return Slots([FragmentSlot.initial(frag, initial_params[frag.fragment_id], steppers[frag.fragment_id], norm_bound)
                  if frag.fragment_id in owned else FragmentSlot.elsewhere(frag) for frag in plan.fragments], layout)
