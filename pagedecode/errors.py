"""Exceptions raised by pagedecode. Each says what went wrong in words a user can act on."""


class PageDecodeError(Exception):
    """Base class of every pagedecode error."""


class InvalidRequestError(PageDecodeError, ValueError):
    """A request that can never be served as given; nothing was queued."""


class InvalidFieldError(InvalidRequestError):
    """An InvalidRequestError about one field of a parameter object: `invalid OWNER.FIELD: REASON`.
    `field` and `reason` let a caller (the server) name the field as its own client spelled it."""

    def __init__(self, owner: str, field: str, reason: str) -> None:
        super().__init__(f"invalid {owner}.{field}: {reason}")
        self.field = field
        self.reason = reason


class AdapterError(InvalidRequestError):
    """A LoRA adapter that cannot be served on this model (its files, shapes, rank or modules);
    the message names the adapter. Nothing was loaded; the engine serves on."""


class UnknownAdapterError(InvalidRequestError):
    """No LoRA adapter by that name is known to the server (--lora-modules, load_lora_adapter)."""


class IllegalTransitionError(PageDecodeError, RuntimeError):
    """A request lifecycle move that the transition table does not allow."""


class DoubleReleaseError(PageDecodeError, RuntimeError):
    """A resource (page, slot, buffer, ...) was released a second time."""


class ModelLoadError(PageDecodeError, ValueError):
    """A checkpoint directory that cannot be loaded (missing file, unsupported architecture)."""


class UnknownRequestError(PageDecodeError, KeyError):
    """No request by that id: never added, or (ForgottenRequestError) finished and forgotten. A
    KeyError too, so a caller looking a request up reads it as one."""

    def __str__(self) -> str:
        return str(self.args[0])


class ForgottenRequestError(UnknownRequestError):
    """The request finished and its record was dropped to bound memory."""


class ModelUnavailableError(PageDecodeError, RuntimeError):
    """A model that can serve no more requests (a tensor-parallel rank failed, or it was closed)."""
