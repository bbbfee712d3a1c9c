"""Admission: a checked request (Intake) joins the engine. It is registered, traced, QUEUED, its
start event goes to the outbox (the next step's first events) and the scheduler's queue takes
it. `add` and `add_all` take the engine's lock (after waiting for a constraint's parse, so the
step loop goes on meanwhile); `enqueue` and `take_outbox` run under it."""
from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from ..errors import InvalidRequestError, ModelUnavailableError
from ..lora.manager import LoRAManager
from ..lora.request import LoRARequest
from ..params import SamplingParams
from ..protocols import Model, ModelParts
from .output.delivery import Attachment, Delivery
from .output.events import Event
from .intake import Intake, paired
from .lifecycle import RequestState
from .registry import RequestRegistry
from .request import Request
from .scheduler import Scheduler


class Admission:
    def __init__(self, intake: Intake, requests: RequestRegistry, delivery: Delivery, scheduler: Scheduler,
                 model: Model, model_name: str, deterministic: bool, lock: threading.RLock,
                 wake: Callable[[], None], lora: LoRAManager) -> None:
        self.intake = intake
        self.requests = requests
        self.delivery = delivery
        self.scheduler = scheduler
        self.model = model
        self.model_name = model_name
        self.deterministic = deterministic
        self._lock = lock
        self._wake = wake
        self.lora = lora
        self.outbox: list[Event] = []       # events of requests added since the last step
        self.prompt_tokens = 0              # prompt tokens added (the engine's snapshot)

    def add(self, prompt: object, params: SamplingParams | None, request_id: str | None, acked: bool,
            attachment: Attachment | None, pinned: bool, lora: LoRARequest | None = None) -> Request:
        """Engine.add_request: refused when the model has failed; the constraint's parse and a
        LoRA adapter's first load are waited for outside the lock (the step loop goes on), then
        the request is made and queued."""
        failure = ModelParts(self.model).failure
        if failure is not None:
            raise ModelUnavailableError(f"the engine serves no more requests: {failure}")
        adapter = self.lora.resolve(lora)
        job = self.intake.parsed_grammar(params)
        with self._lock:
            req = self.intake.make(prompt, params, self.requests.new_id() if request_id is None else request_id, job,
                                   adapter)
            self.delivery.open(req, acked, attachment)
            self.enqueue(req)
            if pinned:
                self.requests.pin(req.request_id)
        return req

    def add_all(self, prompts: Any, params: SamplingParams | Sequence[SamplingParams] | None,
                lora: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[Request]:
        """Engine.generate's requests: all checked before any is queued (a bad one raises and
        queues nothing). lora: one adapter for all, or one (or None) per prompt."""
        prompts, plist = paired(prompts, params)
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, LoRARequest) else list(lora)
        if len(loras) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        adapters = [self.lora.resolve(one) for one in loras]
        jobs = [self.intake.parsed_grammar(sp) for sp in plist]
        with self._lock:
            reqs = self.intake.make_all(prompts, plist, jobs, self.requests, adapters)
            for req in reqs:
                self.enqueue(req)
        return reqs

    def enqueue(self, req: Request) -> None:
        self.requests.add(req)
        req.trace.add("added", prompt_tokens=len(req.prompt_ids), seed=req.seed, deterministic=self.deterministic)
        req.transition(RequestState.QUEUED)
        self.prompt_tokens += len(req.prompt_ids)
        self.delivery.start(req, self.model_name, self.outbox)
        self.scheduler.add(req)
        self._wake()

    def take_outbox(self) -> list[Event]:
        """The start events since the last call (a step's first events)."""
        events, self.outbox = self.outbox, []
        return events
