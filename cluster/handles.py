"""Deployment handles as the router and the workers use them: `HandleWorkers` (the router's
`router.ingress.Workers` over the worker deployment's handle: streams, lost workers named,
every replica's load report) and `DraftAddress` (where a worker's drafter finds a draft
replica). Thin: Serve calls and their failure modes only."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

import ray
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from mxserve.api.errors import WorkerLostError
from mxserve.api.outputs import StepOutput, decode_output
from mxserve.api.sampling_params import SamplingParams
from mxserve.cluster.output_channel import OutputReceiver, merge_piled

logger = logging.getLogger(__name__)
LOAD_TIMEOUT_S = 1.0  # the longest the router waits for one worker's load report


class DraftAddress:
    """Where a worker's drafter (worker/draft_channel.RemoteDrafter) finds a draft replica:
    answered at once with the address the last handle call gave. Each call (a connection being
    made: the first, or one after a failure) asks for a fresh one in the background, and
    `keep_fresh` asks every period_s, so a replica Serve has replaced is found within one retry
    or period. The engine's thread never waits on Serve."""

    def __init__(self, handle: DeploymentHandle, loop: asyncio.AbstractEventLoop,
                 period_s: float = 2.0) -> None:
        self.handle, self.loop, self.period_s = handle, loop, period_s
        self.value: str | None = None
        self._refreshing = False

    async def keep_fresh(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            if not self._refreshing:
                self._refreshing = True
                await self.refresh(timeout_s=5 * self.period_s)

    async def refresh(self, timeout_s: float = 60.0) -> None:
        try:
            self.value = await asyncio.wait_for(self.handle.address.remote(), timeout_s)
        except Exception as e:  # no replica yet, or it died on the way
            logger.warning("no draft replica address (%r); drafting resumes once one answers", e)
        finally:
            self._refreshing = False

    def __call__(self) -> str | None:
        if not self._refreshing:
            self._refreshing = True
            asyncio.run_coroutine_threadsafe(self.refresh(), self.loop)
        return self.value


@contextlib.contextmanager
def _apart_from_its_caller():
    """Handle calls made inside, with an internal request id of their own. Serve gives a call
    made while serving a request that request's internal id, and its request router keys the
    calls it is placing by that id: two calls at once for one request (a completion's batch of
    prompts) would lose one, which then never reaches a worker."""
    from ray.serve import context

    current = context._get_serve_request_context()
    token = context._serve_request_context.set(
        dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex))
    try:
        yield
    finally:
        context._serve_request_context.reset(token)


DIRECT_TAIL_S = 30.0  # after a direct stream's Serve call ended, the longest its last output
_SERVE_END = object()  # may take to come over the output channel


async def _pump(response, inbox: asyncio.Queue) -> None:
    """A direct stream's Serve call into its inbox: its outputs (a hand-back), then its end
    or its error."""
    try:
        async for data in response:
            inbox.put_nowait(decode_output(data))
        inbox.put_nowait(_SERVE_END)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        inbox.put_nowait(e)


class HandleWorkers:
    """`router.ingress.Workers` over a Serve deployment handle. With a receiver (direct
    streams, cluster/output_channel.py) the engine's outputs come over it and the Serve call
    carries the rest: routing, admission errors, the request's lifetime, a hand-back."""

    def __init__(self, handle: DeploymentHandle, app_name: str, deployment: str,
                 receiver: OutputReceiver | None = None) -> None:
        self.handle = handle.options(stream=True)
        self.receiver = receiver
        self._pumps: set[asyncio.Task] = set()  # Serve calls of direct streams, read to their end
        self.replica_prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
        # replica actor id (hex) -> worker id, to name the worker a lost stream was on: the
        # error names the actor, and a dead actor's name can no longer be looked up
        self.worker_ids: dict[str, str] = {}
        self._listed_at = float("-inf")
        self._listing: asyncio.Task | None = None

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str, **hints) -> AsyncIterator[StepOutput]:
        """The worker's outputs (sent as `encode_output` bytes). Raises WorkerLostError,
        naming the worker, when the worker's replica died or stopped answering under the
        stream: a SIGKILLed or lost replica's gRPC stream breaks with ActorUnavailableError;
        over Ray's object store it is an ActorDiedError."""
        self._keep_listed()
        if self.receiver is not None:  # (closed with this generator: the abort goes at once)
            async with contextlib.aclosing(self._direct(prompt_token_ids, params, request_id,
                                                        hints)) as outs:
                async for out in outs:
                    yield out
            return
        with _apart_from_its_caller():
            response = self.handle.generate.remote(prompt_token_ids, params, request_id,
                                                   **hints)
        finished = False
        try:
            async for data in response:
                out = decode_output(data)
                finished = out.finished
                yield out
        except (RayActorError, ActorUnavailableError) as e:
            raise self._lost(e) from None
        finally:
            if not finished:  # closed early (cancel, deadline, stop string): abort there
                response.cancel()

    async def _direct(self, prompt_token_ids: list[int], params: SamplingParams,
                      request_id: str, hints: dict) -> AsyncIterator[StepOutput]:
        """`generate` with the outputs over the receiver: one queue takes both those and what
        the Serve call brings (a hand-back, its end, its error), each in its own order."""
        key = uuid.uuid4().hex
        inbox = self.receiver.open(key)
        with _apart_from_its_caller():
            response = self.handle.generate.remote(prompt_token_ids, params, request_id,
                                                   stream_to=self.receiver.target(key), **hints)
        pump = asyncio.create_task(_pump(response, inbox))
        self._pumps.add(pump)
        pump.add_done_callback(self._pumps.discard)
        finished, serve_ended = False, False
        held = None  # taken from the inbox while merging, handled next
        try:
            while True:
                if held is not None:
                    item, held = held, None
                elif serve_ended:  # the last output was sent before the call ended: it comes
                    try:
                        item = await asyncio.wait_for(inbox.get(), DIRECT_TAIL_S)
                    except TimeoutError:
                        raise WorkerLostError(f"its outputs stopped coming over the output "
                                              f"channel ({DIRECT_TAIL_S:g} s)", "") from None
                else:
                    item = await inbox.get()
                if item is _SERVE_END:
                    serve_ended = True
                    continue
                if isinstance(item, (RayActorError, ActorUnavailableError)):
                    raise self._lost(item)
                if isinstance(item, BaseException):
                    raise item
                item, held = merge_piled(item, inbox)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self.receiver.close(key)
            if not finished:  # closed early: abort there (a finished call ends by itself)
                response.cancel()
                pump.cancel()

    def _lost(self, e: Exception) -> WorkerLostError:
        """A lost replica's error: a SIGKILLed or lost replica's gRPC stream breaks with
        ActorUnavailableError; over Ray's object store it is an ActorDiedError."""
        worker_id = self.worker_ids.get(getattr(e, "actor_id", None), "")
        return WorkerLostError(f"its worker {worker_id or '(unknown)'} is gone "
                               f"({type(e).__name__})", worker_id)

    def _keep_listed(self, max_age_s: float = 5.0) -> None:
        """Refresh `worker_ids` in the background when older than max_age_s (replicas come and
        go only when Serve replaces or scales them)."""
        if time.monotonic() - self._listed_at > max_age_s and (
                self._listing is None or self._listing.done()):
            self._listed_at = time.monotonic()
            self._listing = asyncio.create_task(asyncio.to_thread(self._replica_actors))

    async def loads(self) -> list[dict]:
        """Ask every worker replica directly: a handle call would reach only one. Replicas are
        Ray actors named SERVE_REPLICA::<app>#<deployment>#<id> in the "serve" namespace."""
        actors = await asyncio.to_thread(self._replica_actors)
        results = await asyncio.gather(
            *(asyncio.wait_for(a.record_routing_stats.remote(), LOAD_TIMEOUT_S) for a in actors),
            return_exceptions=True)  # a replica that does not answer in time is left out
        return sorted((r for r in results if isinstance(r, dict) and r),
                      key=lambda r: r["worker_id"])

    def _replica_actors(self) -> list:  # blocking GCS calls: run off the event loop
        actors = []
        for worker_id, actor in replica_actors(self.replica_prefix):
            self.worker_ids[actor._actor_id.hex()] = worker_id
            actors.append(actor)
        return actors


def replica_actors(prefix: str, known: dict | None = None) -> list[tuple[str, object]]:
    """(replica id, actor handle) of every live replica of a deployment: Ray actors named
    SERVE_REPLICA::<app>#<deployment>#<id> in the "serve" namespace. Blocking GCS calls: run
    off the event loop. known: name -> handle, looked up once a name (and kept to the listed)."""
    names = [n["name"] for n in ray.util.list_named_actors(all_namespaces=True)
             if n["namespace"] == "serve" and n["name"].startswith(prefix)]
    if known is not None:
        for name in [n for n in known if n not in names]:
            del known[name]
    found = []
    for name in names:
        actor = known.get(name) if known is not None else None
        if actor is None:
            try:
                actor = ray.get_actor(name, namespace="serve")
            except ValueError:  # gone since it was listed
                continue
            if known is not None:
                known[name] = actor
        found.append((name.removeprefix(prefix), actor))
    return found


class ReplicaDirectory:
    """The worker replicas as cluster/intake.IntakeWorkers routes over them: each one's load
    report with its intake target (`record_routing_stats`, asked of every replica directly;
    one that does not answer in LOAD_TIMEOUT_S is left out this time)."""

    def __init__(self, app_name: str, deployment: str) -> None:
        self.prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
        self._known: dict[str, object] = {}
        self._last: dict[str, dict] = {}  # replica id -> its last entry
        self._asked: dict[str, asyncio.Future] = {}  # replica id -> its report on the way

    async def __call__(self) -> list[dict]:
        """Every listed replica that has answered once: a replica still listed whose report
        does not come in time this once (its loop busy) keeps its last one."""
        actors = await asyncio.to_thread(replica_actors, self.prefix, self._known)
        # a report later than LOAD_TIMEOUT_S (a replica still starting, a busy loop) is not
        # asked again: the next listing takes it once it comes
        for replica_id, actor in actors:
            if replica_id not in self._asked:
                self._asked[replica_id] = asyncio.ensure_future(
                    actor.record_routing_stats.remote())
        results = await asyncio.gather(
            *(asyncio.wait_for(asyncio.shield(self._asked[r]), LOAD_TIMEOUT_S)
              for r, _ in actors), return_exceptions=True)
        listed = {replica_id for replica_id, _ in actors}
        self._last = {r: e for r, e in self._last.items() if r in listed}
        self._asked = {r: f for r, f in self._asked.items() if r in listed and not f.done()}
        for (replica_id, _), result in zip(actors, results):
            if isinstance(result, dict) and result.get("intake"):
                meta = result.pop("intake")
                self._last[replica_id] = {"worker_id": result["worker_id"], "meta": meta,
                                          "load": result}
        return sorted(self._last.values(), key=lambda e: e["worker_id"])

