"""The engine for a batch: claim a chunk just before running it, store each outcome as soon as
its work is done.

How a batch goes. Keys are checked, and a key repeated inside the batch is set aside behind its
first copy. Then, over and over, one round trip stores the outcomes of the handlers that ran since
the last one, releases the claims of those that failed (and of any given back), and claims the
next *chunk*; the chunk's handlers run one after the other, their leases renewed meanwhile. The
chunk is sized from what was seen so far (how long handlers take, how many claims start one) so
that its handlers should take about ``flush_after`` (default 5 ms): one message at a time for slow
handlers, the whole batch for fast ones or for duplicates (:class:`Pacing`). Once the handlers
that finished since the last round trip reach ``flush_after`` together, the chunk stops: the
claims it has not started are given back, and the next round trip stores those outcomes before
any other handler starts.

Overlap: a chunk is claimed by several ``claim.lua`` calls, all sent in the round trip's one
write, and its replies are read one call at a time: the first sub-chunk's handlers run while Redis
still claims the next, instead of the client waiting for the whole chunk and Redis then idling
while the client works. A call carries at least :data:`STREAM_STEP` claims and about 1 ms of
handler work (:meth:`Pacing.step`): where the chunk's handlers take less than that together (fast
handlers, duplicates), there is nothing to overlap and the chunk is one call, as each call's reply
is read and answered on its own. Replies are still read in order and every claim is answered before
its handler runs; a connection lost after some sub-chunks were answered defers the rest
(STORE_UNAVAILABLE: claimed or not, we cannot tell), and what already ran is stored by the next
round trip.

Crash story: a crash can lose the stored outcome of at most the handlers that finished within the
last ``flush_after`` (their total run time), plus the handler that was running; on redelivery
those run again, under larger fencing tokens, once their leases (renewed until the crash) run
out. Every other handler's outcome is in Redis, so its redelivery answers DUPLICATE. Claims are
held only for the chunk being run, so a crash strands at most that chunk for a lease, and other
consumers are never deferred by claims of messages nobody has started.

One engine for sync and asyncio: every step here is a flow (:mod:`dedupe_worker._protocol.flows`)
that yields its round trips and handler calls; :func:`decide_many` drives it with blocking calls
and ``dedupe_worker.asyncio.decide_many`` on an event loop (``async def`` handlers awaited; the
claims of a chunk are handed on once its round trip is read, as asyncio has no held connection
to stream replies on).

Copies: a later copy of a key in the batch is claimed once its first copy is decided, in the
next round trip, so it gets the store's answer (DUPLICATE from the outcome just stored, or the
other worker's IN_PROGRESS or CONFLICT); a copy of one whose handler failed or whose outcome could
not be stored is deferred as IN_PROGRESS without a claim.

Bookkeeping is kept per batch, in columns (one list per field, indexed by item), not in objects
per message: a duplicate costs list slots and no object at all, and the :class:`Decision` of an
ACK (APPLIED or DUPLICATE) is built only when a caller asks for it (:class:`Verdicts`): the Kafka
consumer asks only for those its hooks or its dead letters need, :func:`decide_many` for all.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._errors import AlreadyApplied, InvalidKey, LeaseLost, StoreUnavailable
from .._protocol import (
    OMITTED,
    STORED,
    Claim,
    ClaimItem,
    ClientCore,
    Flow,
    Handler,
    Outcome,
    Request,
    Run,
    Stored,
    Stream,
    StreamCut,
    bind,
    ttl_ms,
    unbind,
)
from .._transport import ClaimClient
from ..observe._base import current as observer
from . import recorded
from .decision import Decision, Reason, in_progress, poison, verdict_of
from .pacing import FLUSH_AFTER, STREAM_STEP, Pacing
from .single import attributes, failure_reason, unavailable_flow

__all__ = ["FLUSH_AFTER", "STREAM_STEP", "Item", "Pacing", "Verdicts", "batch_flow", "decide_many", "verdicts_flow"]

log = logging.getLogger(__name__)


#: ``(key, fingerprint, handler)``
Item = tuple[str | bytes, Any, Callable[[], Any]]

#: Verdicts of a first copy after which its later copies are claimed: the key has a stored outcome,
#: or is held by another worker, so the store's answer is right for the copies too. After the
#: others (our handler failed, our lease was lost, Redis failed) a copy is deferred unclaimed,
#: so one batch never runs a key twice.
_ASK_STORE = frozenset({Reason.APPLIED, Reason.DUPLICATE, Reason.PREVIOUSLY_FAILED, Reason.PERMANENT_FAILURE,
                        Reason.UNSERIALIZABLE_RESULT, Reason.CONFLICT, Reason.IN_PROGRESS,
                        Reason.UNREADABLE_RECORD})


#: A handler that finished, its outcome going out with the next round trip:
#: ``(index, claim, decision, record)``: ``decision`` is ``None`` for APPLIED (the value is in
#: the batch's ``values``: built when asked for), ``record`` the ``(status, data)`` to store, or
#: ``None`` to release the claim. (A tuple: one is made per message.)
_Done = tuple[int, Claim, "Decision | None", "tuple[Stored, bytes] | None"]

_ACQUIRED = Outcome.ACQUIRED
#: What a ``None`` result is stored as with the default serializer (``null_is_json``).
_NULL = (Stored.COMPLETED, b"null")
_ACQUIRED_CODE, _DUPLICATE_CODE = Outcome.ACQUIRED.value, Outcome.DUPLICATE.value
_COMPLETED, _OMITTED = Stored.COMPLETED, Stored.OMITTED
_stored_status = STORED.get  # a status letter as Redis returned it -> Stored (None for one we never write)
_APPLIED, _DUPLICATE, _LEASE_LOST = Reason.APPLIED, Reason.DUPLICATE, Reason.LEASE_LOST


def _called(handler: Callable[[], Any]) -> Any:
    """The ``call`` of :func:`verdicts_flow` for items that carry their own handlers."""
    return handler()


class _Batch:
    """One batch's state, a column per field (see the module doc)."""

    def __init__(self, dedupe: ClientCore, keys: Sequence[str | bytes], fingerprints: Sequence[Any] | None,
                 call: Callable[[Any], Any], subjects: Sequence[Any], pacing: Pacing,
                 run_batch: Callable[[list[int]], Any] | None, integration: str = "run",
                 ttl: float | Sequence[float | None] | None = None) -> None:
        count = len(keys)
        if (fingerprints is not None and len(fingerprints) != count) or len(subjects) != count:
            raise ValueError("keys, fingerprints and handlers must match one to one")
        self.dedupe = dedupe
        #: Each item's ttl (seconds its outcome is kept), ``None`` when all use ``result_ttl``.
        self.ttls = _ttls(ttl, count)
        self.integration = integration
        self.given_keys = keys
        self.fingerprints = fingerprints
        #: An item's handler is ``call(subjects[i])``.
        self.call = call
        self.subjects = subjects
        self.pacing = pacing
        self.run_batch = run_batch
        # the columns: what was asked (the key as text, its stem, its fingerprint and original as sent) ...
        self.texts: list[str] = [""] * count
        self.stems: list[str] = [""] * count
        self.fps: list[str] = [""] * count
        self.origs: list[str] = [""] * count
        # ... and what was decided: the reason once decided, the Decision once built, and what a
        # Decision built later is made of (APPLIED: the claim and the handler's value; DUPLICATE:
        # the token and the stored value, or OMITTED)
        self.reasons: list[Reason | None] = [None] * count
        self.decisions: list[Decision | None] = [None] * count
        self.claims: list[Claim | None] = [None] * count
        self.tokens: list[int] = [0] * count
        self.values: list[Any] = [None] * count
        self.queue: list[int] = []  # first copies not claimed yet, in order
        self.copies: dict[int, list[int]] = {}  # first copy -> later copies waiting for it
        self.ready: list[int] = []  # copies whose first copy is decided: claim them next
        self.done: list[_Done] = []  # finished, outcome not stored yet
        self.done_seconds = 0.0  # handler time of ``done``
        self.releases: list[Claim] = []  # claims given back before their handler started
        self.held: list[int] = []  # the lease groups of the claims taken since the last round trip
        self.outage: StoreUnavailable | None = None  # set once a round trip failed
        self.chunk: list[int] = []  # what the current round trip claims
        self.stopped = False  # the chunk stopped: its claims not started are given back
        self.given_back: list[int] = []  # ... those, in order, to be queued again after the round trip
        self.interrupt: BaseException | None = None  # a handler's BaseException, raised once stored
        #: Whether a ``None`` result is stored as :data:`_NULL` (the codec's ``null_is_json``): then
        #: finished() stores it without a call to encode().
        self.nulls = dedupe.null_is_json

    # -- the loop -------------------------------------------------------------------------------

    def decide(self) -> Flow[Verdicts]:
        self.prepare()
        queue, texts = self.queue, self.texts
        while queue or self.ready or self.done:
            size = len(queue) if self.run_batch is not None else self.pacing.chunk(len(queue))
            chunk = queue[-size:] if size else []
            del queue[len(queue) - size:]
            chunk.reverse()
            chunk += self.ready
            self.ready = []
            flowing = yield from self.flush(chunk)
            if self.interrupt is not None:
                yield from self.stop()
            if not flowing:
                break
        for waiting in self.copies.values():  # copies behind a first copy that was never decided
            for i in waiting:
                if self.reasons[i] is None:
                    self.verdict(i, in_progress(texts[i], 0.0))
        if observer.enabled:
            for reason in self.reasons:
                observer.decided(self.integration, reason.value)  # type: ignore[union-attr]
        return Verdicts(self)

    def prepare(self) -> None:
        """Check the keys into their stems (an invalid one decided at once) and queue the first
        copy of each key, its later copies set aside behind it."""
        codec, keys, fingerprints, queue = self.dedupe, self.given_keys, self.fingerprints, self.queue
        first: dict[str, int] = {}  # stem -> index of its first copy
        texts, stems, fps, origs = self.texts, self.stems, self.fps, self.origs
        for i, key in enumerate(keys):
            try:
                texts[i], stem, fps[i], origs[i] = codec.prepare(key, None if fingerprints is None else fingerprints[i])
            except InvalidKey as exc:
                self.verdict(i, poison(exc))
                continue
            stems[i] = stem
            seen = first.setdefault(stem, i)
            if seen == i:
                queue.append(i)
            else:
                self.copies.setdefault(seen, []).append(i)
        queue.reverse()  # taken from the end

    def verdict(self, i: int, decision: Decision) -> None:
        """Record ``i``'s verdict, built now; its copies are claimed next when its key now has a
        record (:meth:`decided`)."""
        self.decisions[i] = decision
        self.reasons[i] = decision.reason
        if self.copies:
            self.decided(i, decision.reason, decision.retry_after)

    def request(self, i: int) -> Request:
        return Request(self.texts[i], self.stems[i], self.fps[i], self.origs[i])

    def handler(self, i: int) -> Callable[[], Any]:
        """Item ``i``'s handler as a call without arguments (for a :class:`Handler` effect)."""
        call, subject = self.call, self.subjects[i]
        return subject if call is _called else functools.partial(call, subject)

    def claimed(self, start: int, flat: list[Any]) -> Flow[None]:
        """``claim.lua``'s flat reply for ``self.chunk[start:]`` came in: decide the keys not
        ACQUIRED and run the others' handlers, unless the chunk was stopped (``flush_after``
        reached, or interrupted): then they are given back (released with the next round trip, and
        queued again). A duplicate of a stored outcome is noted in the columns; its Decision (and
        the stored value, decoded) is built only when asked for."""
        acquired = []
        texts, stems, fps, reasons, tokens, values = (self.texts, self.stems, self.fps, self.reasons, self.tokens,
                                                      self.values)
        copies, ttls = self.copies, self.ttls
        indices = self.chunk[start:start + len(flat) // 4]
        if len(flat) != 4 * len(indices):
            raise ValueError(f"{len(flat)} reply values for {len(indices)} claims")
        for i, code, token, status, value in zip(indices, flat[0::4], flat[1::4], flat[2::4], flat[3::4],
                                                 strict=True):
            if code == _ACQUIRED_CODE:
                acquired.append((i, Claim(texts[i], _ACQUIRED, token, None, 0.0, False, None, stems[i], fps[i],
                                          status == 1, None if ttls is None else ttls[i])))
                continue
            stored = _stored_status(status) if code == _DUPLICATE_CODE else None
            if stored is _COMPLETED or stored is _OMITTED:
                tokens[i], values[i], reasons[i] = token, OMITTED if stored is _OMITTED else value, _DUPLICATE
                if copies:
                    self.decided(i, _DUPLICATE, 0.0)
                continue
            # a record the script could not read is UNREADABLE for this key alone (its verdict: set aside)
            claim = self.dedupe.claim_of(self.request(i), code, token, status, value)
            if ttls is not None and ttls[i] is not None:
                claim = self.dedupe.with_ttl([claim], ttls[i])[0]
            decision = verdict_of(claim)
            assert decision is not None
            self.verdict(i, decision)
        self.pacing.claimed(len(indices), len(acquired))
        if not acquired:
            return
        # each lease is renewed from its claim until its outcome is stored or its claim released
        # (the next round trip: every claim of a chunk is stored or released by it)
        self.held.append(self.dedupe.renewer.track_group([claim for _, claim in acquired]))
        if recorded.outcomes_of(self.dedupe) is not None:
            acquired = yield from self.found_before(acquired)
        if self.stopped:
            self.give_back(acquired)
        else:
            yield from self.run(acquired)

    def found_before(self, acquired: list[tuple[int, Claim]]) -> Flow[list[tuple[int, Claim]]]:
        """The claims whose handlers must run: a re-claimed key whose earlier run committed its
        outcome in the database (engine/recorded.py) is DUPLICATE, stored with the next round trip."""
        run = []
        for i, claim in acquired:
            found = (yield from recorded.lookup_flow(self.dedupe, claim)) if claim.reclaimed else None
            if found is None:
                run.append((i, claim))
            else:
                self.failed(i, claim, found)
        return run

    def give_back(self, acquired: list[tuple[int, Claim]]) -> None:
        """Claims whose handlers will not start in this chunk: released with the next round trip;
        queued again (first) unless interrupted."""
        self.releases.extend(claim for _, claim in acquired)
        if self.interrupt is None:
            self.given_back.extend(i for i, _ in acquired)

    def run(self, acquired: list[tuple[int, Claim]]) -> Flow[None]:
        """Run the handlers of claimed messages. Once those that finished reach ``flush_after``, the
        chunk stops: the claims not started yet are given back, so their outcomes are stored before
        another handler starts and nobody holds idle claims. A ``BaseException`` (``KeyboardInterrupt``,
        ``SystemExit``) stops it too, and is raised once what finished is stored (:meth:`stop`)."""
        run = recorded.opened(self.dedupe)
        try:
            if self.run_batch is not None:
                yield from self.call_batch(acquired)
            else:
                yield from self.call_each(acquired)
        except GeneratorExit:
            raise
        except BaseException as exc:
            self.interrupt, self.stopped = exc, True
            finished = {d[0] for d in self.done}
            self.releases.extend(claim for i, claim in acquired
                                 if i not in finished and self.reasons[i] is None)
        finally:
            recorded.closed(run)
        if run is not None and run.joined:
            yield from self.confirm(run)

    def confirm(self, run: Run) -> Flow[None]:
        """Handlers whose ``atomic()`` joined a transaction it did not open: an outcome is stored
        only once its row is confirmed committed; otherwise the claim is released (engine/recorded.py)."""
        for n, (i, claim, decision, record) in enumerate(self.done):
            if decision is None and record is not None:
                uncommitted = yield from recorded.uncommitted_flow(claim, run)
                if uncommitted is not None:
                    self.done[n] = (i, claim, Decision(Reason.HANDLER_ERROR, claim, error=uncommitted), None)

    def stop(self) -> Flow[None]:
        """After an interrupt: store what finished, free what did not, and raise it."""
        try:
            yield from self.flush([])
        except Exception as exc:
            log.warning("could not store or release claims while stopping: %s", exc)
        assert self.interrupt is not None
        raise self.interrupt

    def call_each(self, acquired: list[tuple[int, Claim]]) -> Flow[None]:
        """The handlers one after the other, until those that finished reach ``flush_after``."""
        observed = observer.enabled
        call, subjects, pacing, finished = self.call, self.subjects, self.pacing, self.finished
        perf, set_claim, reset_claim = time.perf_counter, bind, unbind  # bind_claim(), inline, as locals
        # The sync driver would perform the Handler effect as a plain call, so the handler is
        # called here: its exception (or BaseException) reaches the same handlers below as when the
        # driver throws it in, without an effect through Steps and three generator frames a
        # handler (docs/performance.md, bench.kafka_cpu).
        inline = self.dedupe.calls_handlers
        last = len(acquired) - 1
        # Per handler, without a call: a None result as finished() stores it, the pacing's running
        # mean (Pacing.mean) and the finished time in locals, written back on the way out: this
        # loop runs once a new key (docs/performance.md, bench.kafka_cpu).
        done, nulls, flush_after = self.done, self.nulls, pacing.flush_after
        mean, done_seconds = pacing.mean, self.done_seconds
        # a handler's time runs from the end of the one before (our bookkeeping between them is
        # counted as its): one clock read a handler
        began = perf()
        try:
            for n, (i, claim) in enumerate(acquired):
                reset = set_claim(claim)
                try:
                    if observed:
                        with observer.span("dedupe.handler", attributes(claim, self.integration)):
                            value = call(subjects[i]) if inline else (yield Handler(self.handler(i)))
                    elif inline:
                        value = call(subjects[i])
                    else:
                        value = yield Handler(self.handler(i))
                except Exception as exc:
                    self.failed(i, claim, exc)
                else:
                    if value is None and nulls:
                        done.append((i, claim, None, _NULL))
                    else:
                        finished(i, claim, value)
                finally:
                    reset_claim(reset)
                ended = perf()
                seconds, began = ended - began, ended
                mean = seconds if mean is None else (mean + seconds) / 2
                done_seconds += seconds
                if observed:
                    observer.handled(self.integration, seconds)
                if done_seconds >= flush_after:
                    self.stopped = True
                    if n < last:
                        self.give_back(acquired[n + 1:])
                    return
        finally:
            pacing.mean, self.done_seconds = mean, done_seconds

    def call_batch(self, acquired: list[tuple[int, Claim]]) -> Flow[None]:
        """One call of the batch handler for every acquired claim; its error is every one's error."""
        assert self.run_batch is not None
        try:
            run_batch, indices = self.run_batch, [i for i, _ in acquired]
            values = list((yield Handler(lambda: run_batch(indices))))
            if len(values) != len(acquired):
                raise ValueError(f"batch handler returned {len(values)} values for {len(acquired)} items")
        except Exception as exc:
            for i, claim in acquired:
                self.failed(i, claim, exc)
            return
        for (i, claim), value in zip(acquired, values, strict=True):
            self.finished(i, claim, value)

    def finished(self, i: int, claim: Claim, value: Any) -> None:
        """A handler returned ``value``: APPLIED (UNSERIALIZABLE_RESULT when JSON cannot hold it,
        stored as omitted), stored with the next round trip."""
        if value is None and self.nulls:  # the common no-op result, as encode() stores it
            self.done.append((i, claim, None, _NULL))
            return
        status, data, problem = self.dedupe.encode(claim, value)
        if problem is not None:
            self.done.append((i, claim, Decision(Reason.UNSERIALIZABLE_RESULT, claim, error=problem), (status, data)))
        else:
            self.values[i] = value
            self.done.append((i, claim, None, (status, data)))

    def failed(self, i: int, claim: Claim, exc: Exception) -> None:
        """A handler raised ``exc``: its claim is released, or the failure stored when permanent.
        :class:`AlreadyApplied` (an earlier run committed in the database) is DUPLICATE, its
        committed result stored as the outcome."""
        if isinstance(exc, AlreadyApplied):
            status, data, _ = self.dedupe.encode(claim, exc.result)
            self.done.append((i, claim, Decision(_DUPLICATE, claim, exc.result), (status, data)))
            return
        reason = failure_reason(self.dedupe, exc)
        record = (Stored.FAILED, self.dedupe.encode_failure(exc)) if reason is Reason.PERMANENT_FAILURE else None
        self.done.append((i, claim, Decision(reason, claim, error=exc), record))

    # -- round trips ----------------------------------------------------------------------------

    def flush(self, chunk: list[int]) -> Flow[bool]:
        """One round trip: store (or release) what is done, release what was given back, then claim
        ``chunk``, whose handlers run as its claims come in (:meth:`claimed`): the claims are asked
        for in sub-chunks (:meth:`Pacing.step`), all in the same write, so the handlers of one run
        while Redis claims the next. ``False`` when Redis failed before any claim came in; what was
        done is then STORE_UNAVAILABLE (stored or not, we cannot tell) and the rest deferred."""
        done, self.done, self.done_seconds = self.done, [], 0.0
        releases, self.releases = self.releases, []
        held, self.held = self.held, []  # settled by this round trip
        renewer = self.dedupe.renewer
        for group in held:
            renewer.settle_group(group)
        outcomes = [(claim, *record) for _, claim, _, record in done if record is not None]
        freed = [*(claim for _, claim, _, record in done if record is None), *releases]
        stems, fps, origs = self.stems, self.fps, self.origs
        claims: list[ClaimItem] = [(stems[i], fps[i], origs[i]) for i in chunk]
        self.chunk, self.stopped, self.given_back = chunk, False, []
        # One call for the batch handler's chunk. Streamed otherwise (in calls of Pacing.step()),
        # but only while ``flush_after`` is well inside the lease: a sub-chunk's claims are not
        # renewed until their reply is read, after the earlier sub-chunks' handlers, and those run
        # only while under ``flush_after``.
        streams = self.run_batch is None and self.pacing.flush_after <= self.dedupe.lease / 2
        step = self.pacing.step(len(chunk)) if streams else max(1, len(chunk))
        try:
            if observer.enabled:  # the same Redis calls as below, timed and in a span
                stored, released = yield from self.observed_flush(outcomes, freed, claims, step)
            else:
                stored, released = yield Stream(outcomes, freed, claims, self.claimed, step)
            self.untrack(held)
            self.settled(done, stored, freed, released)
        except StreamCut as exc:  # some claims came in (and their handlers ran), the rest did not
            self.outage = exc
            self.untrack(held)
            self.settled(done, exc.stored, freed, exc.released)
            ready, self.ready = self.ready, []
            yield from self.unavailable([*chunk[exc.claimed:], *self.requeue(), *ready])
            self.queue.clear()
            return True  # what ran is stored (or found STORE_UNAVAILABLE) by the next round trip
        except StoreUnavailable as exc:
            self.untrack(held)
            for i, claim, _, _ in done:
                self.verdict(i, Decision(Reason.STORE_UNAVAILABLE, claim, error=exc, retry_after=self.dedupe.lease))
            self.outage = exc
            yield from self.unavailable([*chunk, *reversed(self.queue)])
            return False
        self.requeue()
        if outcomes and log.isEnabledFor(logging.DEBUG):
            log.debug("stored %d outcome(s), claimed %d", len(outcomes), len(chunk))
        return True

    def observed_flush(self, outcomes: list[tuple[Claim, Stored, bytes]], freed: list[Claim],
                       claims: list[ClaimItem], step: int) -> Flow[tuple[list[bool], list[bool]]]:
        """:meth:`flush`'s round trip with observers on: the same ``stream_claims`` call, in a
        ``dedupe.flush`` span (the handlers run while its replies stream in are its children) and
        timed without the time spent in those handlers."""
        op = "complete_and_claim" if outcomes and claims else ("claim" if claims else "complete")
        inside = 0.0

        def claimed(start: int, flat: list[Any]) -> Flow[None]:
            nonlocal inside
            began = time.perf_counter()
            try:
                yield from self.claimed(start, flat)
            finally:
                inside += time.perf_counter() - began

        with observer.span("dedupe.flush", {"dedupe.integration": self.integration,
                                            "dedupe.stored": len(outcomes), "dedupe.claimed": len(claims)}):
            began = time.perf_counter()
            settled: tuple[list[bool], list[bool]] = yield Stream(outcomes, freed, claims, claimed, step)
            observer.round_trip(op, time.perf_counter() - began - inside)
        return settled

    def requeue(self) -> list[int]:
        """Queue the claims given back in this chunk again, to be claimed first; return the queue
        in order."""
        self.queue.extend(reversed(self.given_back))
        self.given_back = []
        return self.queue[::-1]

    def settled(self, done: list[_Done], stored: list[bool], freed: list[Claim], released: list[bool]) -> None:
        """The verdicts of ``done`` once Redis answered whether their outcomes were ``stored``."""
        ok = iter(stored)
        reasons, claims, copies = self.reasons, self.claims, self.copies
        for i, claim, decision, record in done:
            if record is not None and not next(ok):
                lost = LeaseLost(claim.key, claim.token)
                decision = Decision(_LEASE_LOST, claim, error=lost, retry_after=self.dedupe.lease)
            if decision is not None:
                self.verdict(i, decision)
                continue
            claims[i], reasons[i] = claim, _APPLIED  # its Decision is built when asked for
            if copies:
                self.decided(i, _APPLIED, 0.0)
        for claim, ok_release in zip(freed, released, strict=True):
            if not ok_release:
                log.warning("release found lease lost key=%s token=%s", claim.key, claim.token)

    def untrack(self, groups: list[int]) -> None:
        """Stop renewing the claims of ``groups``: their outcomes are stored, or they were released
        (or the round trip that did so failed, and their leases run out)."""
        renewer = self.dedupe.renewer
        for group in groups:
            renewer.untrack_group(group)

    def decided(self, i: int, reason: Reason, retry_after: float) -> None:
        """``i`` is decided (``reason``): its copies are claimed next when its key now has a
        record, else deferred."""
        waiting = self.copies.pop(i, None)
        if waiting and reason in _ASK_STORE:
            self.ready.extend(waiting)
        elif waiting:
            for copy in waiting:
                self.decisions[copy] = decision = in_progress(self.texts[copy], retry_after)
                self.reasons[copy] = decision.reason

    def unavailable(self, unclaimed: list[int]) -> Flow[None]:
        """Redis failed: defer ``unclaimed`` (or, ``fail_open``, run them) and the copies waiting."""
        assert self.outage is not None
        runs = [(self.texts[i], self.handler(i)) for i in unclaimed]
        for i, decision in zip(unclaimed, (yield from unavailable_flow(self.dedupe, self.outage, runs)), strict=True):
            self.verdict(i, decision)
        # the copies still waiting, and (fail_open) those of the first copies just run, which would
        # be claimed next: deferred, so one batch never runs a key twice
        ready, self.ready = self.ready, []
        for copy in [*ready, *(copy for waiting in self.copies.values() for copy in waiting)]:
            if self.reasons[copy] is None:
                self.decisions[copy] = Decision(Reason.STORE_UNAVAILABLE, error=self.outage, retry_after=1.0)
                self.reasons[copy] = Reason.STORE_UNAVAILABLE
        self.copies.clear()

    # -- verdicts built when asked for ----------------------------------------------------------

    def built(self, i: int) -> Decision:
        """Item ``i``'s :class:`Decision`: the one made when it was decided, or (an APPLIED or a
        DUPLICATE kept in the columns) built now, once."""
        decision = self.decisions[i]
        if decision is not None:
            return decision
        if self.reasons[i] is _APPLIED:
            claim = self.claims[i]
            assert claim is not None
            decision = Decision(_APPLIED, claim, self.values[i])
        else:  # DUPLICATE of a stored outcome, from claim.lua's reply
            key, token, value = self.texts[i], self.tokens[i], self.values[i]
            result = value if value is OMITTED else self.dedupe.stored_result(key, token, value)
            claim = Claim(key, Outcome.DUPLICATE, token, result, stem=self.stems[i], fingerprint=self.fps[i],
                          ttl=None if self.ttls is None else self.ttls[i])
            decision = Decision(_DUPLICATE, claim, result)
        self.decisions[i] = decision
        return decision


class Verdicts(Sequence[Decision]):
    """The verdicts of a batch, in the order of its items. :attr:`reasons` holds every item's
    :class:`Reason` at once; ``verdicts[i]`` is its :class:`Decision`, built the first time it is
    asked for (an ACK's is never built when nobody asks: a consumer that only acks pays for none).
    Read-only; iterating builds them all."""

    __slots__ = ("_batch", "reasons")

    def __init__(self, batch: _Batch) -> None:
        self._batch = batch
        #: Each item's reason.
        self.reasons: list[Reason] = batch.reasons  # type: ignore[assignment]  # every item is decided

    def __len__(self) -> int:
        return len(self.reasons)

    def __getitem__(self, i: int) -> Decision:  # type: ignore[override]
        if not -len(self.reasons) <= i < len(self.reasons):
            raise IndexError(i)
        return self._batch.built(i % len(self.reasons))

    def __iter__(self) -> Iterator[Decision]:
        built = self._batch.built
        return (built(i) for i in range(len(self.reasons)))

    def all(self) -> list[Decision]:
        """Every verdict, built."""
        built = self._batch.built
        return [built(i) for i in range(len(self.reasons))]


def verdicts_flow(dedupe: ClientCore, keys: Sequence[str | bytes], fingerprints: Sequence[Any] | None,
                  call: Callable[[Any], Any], subjects: Sequence[Any], *,
                  run_batch: Callable[[list[int]], Any] | None = None, pacing: Pacing | None = None,
                  integration: str = "run", ttl: float | Sequence[float | None] | None = None) -> Flow[Verdicts]:
    """The batch engine over columns: item ``i`` is ``keys[i]`` with ``fingerprints[i]`` (``None``:
    none for any), handled by ``call(subjects[i])`` (a consumer's handler and its messages: no
    callable per message); its :class:`Verdicts` build a Decision only when asked for. What
    :func:`batch_flow` and the consumers run, on either driver."""
    return _Batch(dedupe, keys, fingerprints, call, subjects, pacing or Pacing(FLUSH_AFTER), run_batch, integration,
                  ttl).decide()


def batch_flow(dedupe: ClientCore, items: Sequence[Item], run_batch: Callable[[list[int]], Any] | None = None,
               flush_after: float | None = None, pacing: Pacing | None = None,
               integration: str = "run", ttl: float | Sequence[float | None] | None = None) -> Flow[list[Decision]]:
    """The flow of :func:`decide_many` (and of ``dedupe_worker.asyncio.decide_many``, which awaits
    the handlers): the batch engine, written once for both drivers."""
    if pacing is None:
        pacing = Pacing(FLUSH_AFTER if flush_after is None else flush_after)
    elif flush_after is not None:
        pacing.flush_after = flush_after
    verdicts = yield from verdicts_flow(dedupe, [key for key, _, _ in items], [fp for _, fp, _ in items], _called,
                                        [handler for _, _, handler in items], run_batch=run_batch, pacing=pacing,
                                        integration=integration, ttl=ttl)
    return verdicts.all()


def decide_many(
    dedupe: ClaimClient,
    items: Sequence[Item],
    *,
    run_batch: Callable[[list[int]], Sequence[Any]] | None = None,
    flush_after: float | None = None,
    pacing: Pacing | None = None,
    integration: str = "run",
    ttl: float | Sequence[float | None] | None = None,
) -> list[Decision]:
    """:func:`~dedupe_worker.decide` for a batch of ``(key, fingerprint, handler)``, in
    order; see the module docstring for when claims are taken and outcomes stored. Never raises
    for bad input, Redis or the handlers' own exceptions.

    ``flush_after`` bounds, in seconds of handler run time, the finished work whose outcome is not
    stored yet (default 5 ms); ``pacing`` carries handler timings from batch to batch (a consumer
    keeps one) and, when given, its ``flush_after`` is used.

    A key repeated inside the batch runs once: its later copies answer DUPLICATE once the first
    copy's outcome is stored, or IN_PROGRESS (deferred, not dropped) when it was not.

    With ``run_batch`` the per-item handlers are not called: ``run_batch(indices)`` is called with
    the indices (into ``items``) of the acquired items and returns their values in that order. The
    whole batch is claimed before it, and every outcome stored right after it. If it raises, every
    one of them gets that error (HANDLER_ERROR, claims released; or PERMANENT_FAILURE, stored).
    ``current_claim()`` is not set inside it.

    ``ttl``: seconds the outcomes are kept instead of ``result_ttl``: one number for every item, or
    one per item (``None`` for ``result_ttl``), e.g. read from each message's header. Raises
    ``ValueError`` before anything is claimed when one is not a positive number.
    """
    return dedupe._drive(batch_flow(dedupe, items, run_batch, flush_after, pacing, integration, ttl))


def _ttls(ttl: float | Sequence[float | None] | None, count: int) -> list[float | None] | None:
    """One ttl per item (checked: ``ValueError`` unless positive), or ``None`` when none is set."""
    if ttl is None:
        return None
    ttls: list[float | None] = [ttl] * count if isinstance(ttl, (int, float)) else list(ttl)
    if len(ttls) != count:
        raise ValueError(f"{len(ttls)} ttls for {count} items")
    if ttls.count(None) == count:  # none set: a consumer's batch without ttl headers
        return None
    for one in ttls:
        if one is not None:
            ttl_ms(one)
    return ttls
