"""The path of one upload through the syncer's parts, from its header to its fold-in.

Owns `Intake`: `validate_header` (ownership of the fragment, then every check that needs no payload:
Admission.validate) and `accept` (the decode permit, decoding, the direction references, the norm
bound, the weight cap and the direction judgment under the fragment's lock, the fold-in into the
round, the counts on the learner), and `Accepted`, the plain result the servicer answers with
(wire_views.upload_response). Every refusal is counted once (Membership.record_rejection) and noted
for the merge ledger (Influence.note_refused).
Must not: build protobuf, decide a check itself (admission.py does) or merge (merging.py does).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import NamedTuple

from ddiloco.algo import merge as merge_lib
from ddiloco.algo import robust as robust_lib
from ddiloco.rpc import errors
from . import admission as admission_lib
from . import influence as influence_lib
from . import membership as membership_lib
from . import merging as merging_lib
from . import slots as slots_lib


class Accepted(NamedTuple):
    """An upload's result, what its UploadFragmentResponse is built from (wire_views.upload_response)."""

    duplicate: bool
    current_version: int
    weight: float


class Intake:
    """Takes uploads into their rounds over the parts it is given (see the module docstring).

    `uploads` is the core's upload counter, shared with the other parts; `emit` tells the observers;
    `tick` re-evaluates the open rounds once a contribution is in (SyncerCore.tick)."""

    def __init__(self, *, slots: slots_lib.Slots, admission: admission_lib.Admission,
                 membership: membership_lib.Membership, rounds: merging_lib.Rounds,
                 directions: robust_lib.DirectionGuard, influence: influence_lib.Influence,
                 uploads: collections.Counter, emit: Callable[..., None], tick: Callable[[], None]) -> None:
        self._slots = slots
        self._admission = admission
        self._membership = membership
        self._rounds = rounds
        self._directions = directions
        self._influence = influence
        self._uploads = uploads
        self._emit = emit
        self._tick = tick

    def validate_header(self, header: admission_lib.UploadHeader) -> admission_lib.UploadTicket:
        """All checks that need no payload (Admission.validate), on the UploadHeader's plain form
        (wire_views.upload_header; the ticket carries it). Raises ServiceError (counted)."""
        try:
            self._slots.require_owned(header.fragment_id)
        except errors.ServiceError as exc:
            self._membership.record_rejection(exc.reason, header.learner_id, exc)
            raise
        return self._admission.validate(header)

    async def accept(self, ticket: admission_lib.UploadTicket, payload: bytes, wire_bytes: int, *,
                     wait_budget_s: float | None = None) -> Accepted:
        """Decodes, bounds, corrects to the current version and folds one contribution into its
        round. Raises ServiceError (counted, on the learner too). `wait_budget_s` bounds how long
        the contribution may wait for others to be judged against (the caller's deadline)."""
        header = ticket.header
        try:
            async with self._admission.decode_permit(payload):  # a payload decoded on arrival holds its own
                return await self._accept(ticket, payload, wire_bytes, wait_budget_s)
        except errors.ServiceError as exc:
            self._membership.record_rejection(exc.reason, header.learner_id, exc, work=admission_lib.work_key(header))
            self._influence.note_refused(header.learner_id, header.fragment_id, exc.reason, exc)
            raise
        finally:  # a proposal waiting for its judgment never outlives the upload
            self._directions.withdraw(header.learner_id, header.fragment_id)

    async def _accept(self, ticket: admission_lib.UploadTicket, payload: bytes, wire_bytes: int,
                      wait_budget_s: float | None) -> Accepted:
        header, admission, rounds = ticket.header, self._admission, self._rounds
        member = self._membership.require_member(header.learner_id, header.incarnation)
        self._membership.count_bytes(member, inbound=wire_bytes, codec=ticket.codec)
        slot = self._slots[header.fragment_id]
        steps = admission.credited_steps(member, header)
        weight = merge_lib.contribution_weight(header.tokens * steps // header.steps if header.steps else 0, steps)
        if ticket.duplicate:
            return self._duplicate(slot, weight)
        decoded = await admission.decode(header, payload)
        await admission.await_direction_references(header, decoded.heading, wait_budget_s)
        contribution_sha256 = await rounds.contribution_sha256(decoded.values)  # for the ledger, before the lock
        async with slot.lock:
            # Re-check under the lock: the round may have moved while decoding (the base version's
            # values stay pinned: it was within the staleness bound when the header arrived).
            ticket = admission.validate(header, pinned_base=ticket.base_params)
            if ticket.duplicate:
                return self._duplicate(slot, weight)
            delta, norms = await admission.bound_norm(slot, member, header, steps, decoded)
            weight = admission.cap_weight(slot, header.learner_id, steps, weight)
            admission.judge_direction(header, decoded.heading, slot.version)
            rnd = rounds.round_for(slot)
            await rounds.fold(slot, rnd, header.fragment_id, delta, norms, weight, ticket.base_params,
                              header.learner_id, steps, decoded=decoded.values, contribution_sha256=contribution_sha256,
                              claims_unverified=admission.claims_unverified(header.learner_id, header.fragment_id))
            admission.accepted(slot, member, header, decoded, norms, steps, weight)
            rounds.add(rnd, header, weight)
            self._emit("upload_accepted", header)
            if header.final:
                member.finished = True  # its progress report saying so may come after this upload
            rounds.note_quorum(rnd)
            version_at_accept = slot.version
        rounds.open_if_nobody_trains()
        self._tick()
        return Accepted(duplicate=False, current_version=version_at_accept, weight=weight)

    def _duplicate(self, slot: slots_lib.FragmentSlot, weight: float) -> Accepted:
        self._uploads["duplicate"] += 1
        return Accepted(duplicate=True, current_version=slot.version, weight=weight)
