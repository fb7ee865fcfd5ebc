"""Publishing to the Hugging Face Hub: one atomic commit per push, safe to retry.

A push is one `upload_folder` call, which the Hub applies as a single commit: either every
file of the export appears in the repo or none does. Retrying after a failure is idempotent:

- large files already uploaded by the failed attempt are skipped (the LFS store already
  has their hash), and never visible in the repo on their own;
- files whose content is already in the repo are dropped from the commit by the client, so a
  retry after a commit that did land (but whose reply was lost) creates no second commit;
- files of an earlier export that the new one does not contain (say, an adapter's
  adapter_config.json when a merged model is pushed to the same repo) are deleted in the
  same commit, so the repo holds exactly one model (MODEL_FILE_PATTERNS; other files stay).

Transient failures (connection errors, HTTP 5xx, 408, 429) are retried here a few times with
a growing pause; authentication problems are reported with how to log in.  huggingface_hub's
HTTP client waits forever by default, and retries each request itself, so a server that stops
answering mid-upload would hang the push: while slothkit pushes, every request huggingface_hub
makes gets connect, read and write timeouts (`timeout_s`), and the whole push one deadline,
`stall_timeout_s` without a byte sent or received, that huggingface_hub's retries and
slothkit's do not extend (hub_client).  Large files go up through the Hub's LFS API, where
those hold and the push stays one commit, rather than Xet (hub_transfers; use_xet=True
opts in).  A push that fails ends in HubConnectionError naming
the URL and the cause; one that ran out of time also says what had been uploaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import re
import tempfile
import time

from torch import nn

from slothkit.export.disk_space import megabytes
from slothkit.export.hub_client import PushStalled, StallClock, hub_client, stalled_in, url_without_query
from slothkit.export.hub_options import HubOptions
from slothkit.export.hub_transfers import upload_protocol
from slothkit.export.save import SaveResult, check_save_method, save_pretrained_merged

LOGIN_HELP = (
    "Log in with `huggingface-cli login` (or `hf auth login`), set the HF_TOKEN environment "
    "variable, or pass token=... — a token with write access, from https://huggingface.co/settings/tokens."
)

# Files that the exports write (weights, configs, tokenizer, card). A push deletes those of an
# earlier export that the new one lacks; other files in the repo (GGUF files, images) stay.
MODEL_FILE_PATTERNS = (
    "*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json",
    "adapter_config.json", "config.json", "generation_config.json", "README.md",
    "chat_template.jinja", "chat_template.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
)  # fmt: skip

DEFAULT_STALL_TIMEOUT_S = HubOptions.stall_timeout_s  # push_to_hub_gguf's default

_TRANSIENT_STATUS = {408, 429}
_NETWORK_ERROR_NAMES = {
    "ConnectError", "ConnectTimeout", "ReadError", "ReadTimeout", "WriteError", "WriteTimeout",
    "PoolTimeout", "RemoteProtocolError", "NetworkError", "TimeoutException", "ConnectionError",
}  # fmt: skip


class HubAuthError(PermissionError):
    """No usable Hugging Face token: missing, invalid, read-only, or without access to the repo."""


class HubConnectionError(ConnectionError):
    """The Hub did not answer (in time, or at all), or kept failing, after the retries."""


REPO_ID_FORM = (
    '"user-or-org/name" (or a bare "name" for the token\'s user): each part 1 to 96 letters, '
    "digits, '-', '_' or '.', not starting or ending with '-' or '.', without '--' or '..', "
    "and not ending in '.git'"
)


def check_repo_id(repo_id, what: str = "repo_id") -> None:
    """Refuse a repo id the Hub would refuse, before any request or any saving: "user/.."
    would otherwise name the parent of the push's scratch folder as the save folder.
    `what` names the argument in the message ("--push" on the command line)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        if not isinstance(repo_id, str):  # validate_repo_id lets None through
            raise HFValidationError("not a string")
        validate_repo_id(repo_id)  # refuses ".", "..", "../x", "user/a/b", "", spaces
    except HFValidationError:
        raise ValueError(
            f"{what} {repo_id!r} is not a Hub repo id; a repo id looks like {REPO_ID_FORM}"
        ) from None


def _request_url(error: BaseException) -> str | None:
    for cause in _causes(error):
        for holder in (cause, getattr(cause, "response", None)):
            try:  # httpx raises RuntimeError for an error without a request
                request = getattr(holder, "request", None)
            except RuntimeError:
                request = None
            url = getattr(request, "url", None)
            if url is not None:
                return url_without_query(url)
    return None


def _cause_text(error: BaseException) -> str:
    """The network error behind `error` as 'TypeName: message', or its HTTP status."""
    causes = list(_causes(error))
    status = next((s for s in map(_status_of, causes) if s is not None), None)
    network = [c for c in causes if any(cls.__name__ in _NETWORK_ERROR_NAMES for cls in type(c).__mro__)]
    cause = network[0] if network else causes[-1]
    # httpx's status errors add a second line (a link to MDN's page on the status): one line.
    first_line = next(iter(str(cause).strip().splitlines()), "")
    # An upload URL's query is a signature (a credential): left out.
    first_line = re.sub(r"(https?://[^\s'\"?]+)\?[^\s'\"]*", r"\1", first_line)
    text = f"{type(cause).__name__}: {first_line}".rstrip(": ")
    if "Timeout" in type(cause).__name__ or isinstance(cause, TimeoutError):
        text += " (the server stopped answering)"
    return f"HTTP {status} ({text})" if status is not None else text


def connection_error(error: BaseException, what: str, fallback_url: str, attempts: int) -> HubConnectionError:
    """A HubConnectionError for a Hub request that failed: what was tried, the URL, the cause."""
    url = _request_url(error) or fallback_url
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    return HubConnectionError(f"{what} failed{tries}: {url}: {_cause_text(error)}")


def stall_error(stalled: PushStalled, repo_id: str) -> HubConnectionError:
    """A HubConnectionError for a push that ran out of time: how long it waited, on what,
    what the Hub had confirmed, and how to resume."""
    if stalled.waited_s >= stalled.stall_s:
        waited = f"nothing was sent to or received from the Hub for {stalled.stall_s:g} s (stall_timeout_s)"
    else:
        left = stalled.stall_s - stalled.waited_s
        waited = (
            f"a request failed with {left:.1f} s left of stall_timeout_s={stalled.stall_s:g}, too little "
            "for the pause before another try"
        )
    cause = f" ({_cause_text(stalled.cause)})" if stalled.cause is not None else ""
    # A PUT the storage confirmed is a whole file, or one part of a large one (multipart).
    if stalled.uploads_confirmed:
        uploaded = (
            f"Before that, the Hub's storage had confirmed {stalled.uploads_confirmed} upload(s), "
            f"{megabytes(stalled.bytes_confirmed)}."
        )
    else:
        uploaded = "No upload had been confirmed."
    if stalled.commit_unanswered:
        committed = "The commit was sent and not answered: it may have landed."
    elif stalled.commits_confirmed:
        committed = f"{stalled.commits_confirmed} commit(s) landed."
    else:
        committed = "Nothing was committed: the repo is as it was."
    return HubConnectionError(
        f"pushing to {repo_id} gave up: {waited}; last request: {stalled.request}{cause}. {uploaded} "
        f"{committed} Push again to resume: a file the Hub holds in full is not uploaded again, and "
        "a commit that landed is not made twice."
    )


@contextlib.contextmanager
def hub_session(options: HubOptions, repo_id: str):
    """Requests of a push to `repo_id` in the block: with the timeouts and stall deadline of
    `options` (hub_client); a push that runs out of time ends in HubConnectionError
    (stall_error).  Yields the block's StallClock (None without a deadline)."""
    with hub_client(options) as clock:
        try:
            yield clock
        except Exception as error:
            stalled = stalled_in(error)
            if stalled is None:
                raise
            raise stall_error(stalled, repo_id) from error


@dataclasses.dataclass
class PushResult:
    repo_id: str
    commit_oid: str
    commit_url: str
    files: list[str]  # paths uploaded (the export folder's contents)
    save: SaveResult | None = None


def _status_of(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


def _causes(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def is_transient(error: BaseException) -> bool:
    """A failure worth retrying: the network, or the server, not the request."""
    for cause in _causes(error):
        status = _status_of(cause)
        if status is not None:
            return status >= 500 or status in _TRANSIENT_STATUS
        if any(cls.__name__ in _NETWORK_ERROR_NAMES for cls in type(cause).__mro__):
            return True
    return False


def _auth_error_or_none(error: BaseException, repo_id: str | None = None) -> HubAuthError | None:
    status = next((s for s in map(_status_of, _causes(error)) if s is not None), None)
    if status == 401:
        return HubAuthError(
            f"the Hugging Face Hub rejected the token (HTTP 401: invalid or expired). {LOGIN_HELP}"
        )
    if status == 403:
        where = f" to {repo_id}" if repo_id else ""
        return HubAuthError(
            f"the token has no write access{where} (HTTP 403). Use a write token for an account or "
            f"organisation that owns the repo. {LOGIN_HELP}"
        )
    return None


def resolve_token(token: str | None, api) -> str:
    """The token to push with, checked against the Hub before any work is done."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE:
        raise ConnectionError(
            "cannot push to the Hugging Face Hub: offline mode is on (HF_HUB_OFFLINE is set). "
            "Unset HF_HUB_OFFLINE (in the environment, before Python starts) to publish."
        )
    token = token or get_token()
    if not token:
        raise HubAuthError(f"no Hugging Face token found. {LOGIN_HELP}")
    try:
        info = api.whoami(token=token)
    except HfHubHTTPError as error:
        auth_error = _auth_error_or_none(error)
        if auth_error is not None:
            raise auth_error from None
        if is_transient(error):
            raise connection_error(error, "checking the token", f"{api.endpoint}/api/whoami-v2", 1) from error
        raise
    except Exception as error:
        if is_transient(error):
            raise connection_error(error, "checking the token", f"{api.endpoint}/api/whoami-v2", 1) from error
        raise
    role = ((info.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise HubAuthError(
            f"the Hugging Face token of {info.get('name')!r} is read-only; pushing needs write access. {LOGIN_HELP}"
        )
    return token


def _upload_failure(error: BaseException) -> RuntimeError | None:
    """huggingface_hub's wrapper of a failed file upload: a bare RuntimeError, "Error while
    uploading 'NAME' to the Hub.", whose cause is the HTTP or network error."""
    for cause in _causes(error):
        if type(cause) is RuntimeError and str(cause).startswith("Error while uploading"):
            return cause
    return None


def _upload(api, folder: pathlib.Path, repo_id: str, token: str, replace_model_files: bool,
            options: HubOptions, clock: StallClock | None):  # fmt: skip
    for attempt in range(options.retries + 1):
        try:
            with upload_protocol(options.use_xet):  # LFS unless use_xet: hub_transfers says why
                return api.upload_folder(
                    repo_id=repo_id,
                    folder_path=str(folder),
                    repo_type="model",
                    token=token,
                    commit_message=options.commit_message,
                    delete_patterns=list(MODEL_FILE_PATTERNS) if replace_model_files else None,
                )
        except Exception as error:
            if stalled_in(error) is not None:
                raise  # out of time: hub_session reports it
            auth_error = _auth_error_or_none(error, repo_id)
            if auth_error is not None:
                raise auth_error from error
            upload_failure = _upload_failure(error)
            transient = is_transient(error)
            if not transient and upload_failure is None:
                raise
            if not transient or attempt == options.retries:
                what = f"uploading {folder} to {repo_id}"
                if upload_failure is not None:  # it names the file
                    what += f" ({str(upload_failure).rstrip('.')})"
                raise connection_error(error, what, f"{api.endpoint}/{repo_id}", attempt + 1) from error
            pause = options.retry_wait_s * 2**attempt
            clock.pause(pause) if clock is not None else time.sleep(pause)
    raise AssertionError("unreachable")


def _push(api, token: str, folder: pathlib.Path, repo_id: str, private: bool, replace_model_files: bool,
          options: HubOptions, clock: StallClock | None) -> PushResult:  # fmt: skip
    """Create the repo if missing and upload `folder` in one commit, with
    options.commit_message (set by the caller)."""
    try:
        repo_url = api.create_repo(repo_id, token=token, private=private, repo_type="model", exist_ok=True)
    except Exception as error:
        auth_error = _auth_error_or_none(error, repo_id)
        if auth_error is not None:
            raise auth_error from error
        if is_transient(error):
            raise connection_error(
                error, f"creating the repo {repo_id}", f"{api.endpoint}/api/repos/create", 1
            ) from error
        raise
    repo_id = getattr(repo_url, "repo_id", None) or repo_id  # "name" alone gains the user's namespace
    info = _upload(api, folder, repo_id, token, replace_model_files, options, clock)
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    return PushResult(repo_id=repo_id, commit_oid=info.oid, commit_url=info.commit_url, files=files)


def push_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    token: str | None = None,
    private: bool = False,
    *,
    commit_message: str | None = HubOptions.commit_message,
    endpoint: str | None = HubOptions.endpoint,
    replace_model_files: bool = True,
    retries: int = HubOptions.retries,
    retry_wait_s: float = HubOptions.retry_wait_s,
    timeout_s: float | None = HubOptions.timeout_s,
    stall_timeout_s: float | None = HubOptions.stall_timeout_s,
    use_xet: bool = HubOptions.use_xet,
) -> PushResult:
    """Upload a saved folder (any export: merged, adapter, GGUF) to `repo_id` in one commit.

    Args:
        folder: the saved folder to upload.
        repo_id: "user/name", "org/name" or a bare "name" (the token's user).
        token: a write token; None: the logged-in one.
        private: create the repo private (an existing repo keeps its visibility).
        commit_message: the commit's message; None: "Upload FOLDER with slothkit".
        endpoint: another Hub (defaults to HF_ENDPOINT / huggingface.co).
        replace_model_files: delete files of an earlier export (MODEL_FILE_PATTERNS) that
            this folder lacks.
        retries: how many times a transient failure is retried (default 2).
        retry_wait_s: the pause before the first retry, doubled at each (default 2.0).
        timeout_s: seconds to wait for the server to answer a read or accept a write
            before the attempt counts as failed (default 60); None: wait forever.
        stall_timeout_s: seconds the push may go without a byte sent to or received from
            the Hub, across every request and retry (huggingface_hub's own included); then
            it gives up with HubConnectionError saying what had been uploaded; pushing
            again resumes (default 180); None: no limit.  Time spent hashing files does
            not count.
        use_xet: upload large files through Xet (hf_xet) where huggingface_hub would:
            deduplicated, usually faster, but under hf_xet's own HTTP client and timeouts,
            which timeout_s and stall_timeout_s do not reach, and possibly in several
            commits.  False (default): through the Hub's LFS API, said once
            (slothkit.export.hub_transfers).

    Raises:
        ValueError: a repo_id the Hub would refuse (check_repo_id), before any request.
        HubAuthError: no usable token.
        HubConnectionError: the Hub did not answer, or kept failing, after the retries, or
            the push ran out of time (stall_timeout_s); the message names the URL and the
            cause, and for the latter what had been uploaded.
    """
    from huggingface_hub import HfApi

    check_repo_id(repo_id)
    folder = pathlib.Path(folder)
    if not folder.is_dir() or not any(folder.iterdir()):
        raise FileNotFoundError(f"{str(folder)!r} is not a non-empty folder; nothing to push")
    options = HubOptions(
        commit_message=commit_message or f"Upload {folder.name} with slothkit",
        endpoint=endpoint,
        retries=retries,
        retry_wait_s=retry_wait_s,
        timeout_s=timeout_s,
        stall_timeout_s=stall_timeout_s,
        use_xet=use_xet,
    )
    api = HfApi(endpoint=options.endpoint)
    with hub_session(options, repo_id) as clock:
        token = resolve_token(token, api)
        return _push(api, token, folder, repo_id, private, replace_model_files, options, clock)


def push_to_hub_merged(
    model: nn.Module,
    repo_id: str,
    tokenizer=None,
    save_method: str = "merged_16bit",
    token: str | None = None,
    private: bool = False,
    *,
    commit_message: str | None = HubOptions.commit_message,
    endpoint: str | None = HubOptions.endpoint,
    retries: int = HubOptions.retries,
    retry_wait_s: float = HubOptions.retry_wait_s,
    timeout_s: float | None = HubOptions.timeout_s,
    stall_timeout_s: float | None = HubOptions.stall_timeout_s,
    use_xet: bool = HubOptions.use_xet,
    **save_kwargs,
) -> PushResult:
    """Save `model` as ``save_pretrained_merged`` does, into a temporary folder, and push
    that folder to the Hugging Face Hub in one commit (module docstring).

    The token is checked first, so a login problem surfaces before any merging.  Also a
    method of the models ``FastModel.get_peft_model`` returns:
    ``model.push_to_hub_merged(repo_id, tokenizer, ...)``.

    Args:
        model: as for ``save_pretrained_merged``: a ``peft.PeftModel`` with LoRA
            adapters, or a plain transformers model.
        repo_id: "user/name" or "org/name"; a bare "name" goes to the token's user.  The
            repo is created when missing.
        tokenizer: the tokenizer to save with the model; None (default) takes the one
            ``FastModel.from_pretrained`` returned.
        save_method: "merged_16bit" (default), "merged_4bit" or "lora", as for
            ``save_pretrained_merged``.
        token: a Hugging Face token with write access; None (default) uses the logged-in
            one (``huggingface-cli login`` or HF_TOKEN).
        private: create the repo private (default False); an existing repo keeps its
            visibility.
        commit_message: the commit's message; None (default): "Upload <save_method>
            model with slothkit".
        endpoint: another Hub's URL; None (default): HF_ENDPOINT or huggingface.co.
        retries: how many times a transient failure (network, HTTP 5xx, 408, 429) is
            retried (default 2).
        retry_wait_s: the pause before the first retry in seconds, doubled at each
            (default 2.0).
        timeout_s: seconds to wait for the server to answer a read or accept a write
            before the attempt counts as failed (default 60); None: wait forever.
        stall_timeout_s: seconds the push may go without a byte sent to or received from
            the Hub, across every request and retry (huggingface_hub's own included); then
            it gives up with HubConnectionError saying what had been uploaded; pushing
            again resumes (default 180); None: no limit.  Time spent saving or hashing
            files does not count.
        use_xet: as for push_folder_to_hub: True uploads through Xet where
            huggingface_hub would, outside timeout_s and stall_timeout_s; False (default):
            through the Hub's LFS API.
        **save_kwargs: passed to ``save_pretrained_merged``: base_weights,
            max_shard_size, dtype, training_settings.

    Returns:
        A ``PushResult``: the repo id, the commit's id and URL, the files uploaded, and
        the ``SaveResult`` of the save.

    Raises:
        HubAuthError: no token, or one that is invalid, read-only or without access to
            the repo; the message says how to log in.
        ConnectionError: HF_HUB_OFFLINE is set; HubConnectionError (a ConnectionError):
            the Hub did not answer, or kept failing, after the retries, or the push ran
            out of time (stall_timeout_s).
        ValueError: a repo_id the Hub would refuse, an unknown save_method, or another
            error of the save.
    """
    from huggingface_hub import HfApi

    check_repo_id(repo_id)
    check_save_method(save_method)
    options = HubOptions(
        commit_message=commit_message or f"Upload {save_method} model with slothkit",
        endpoint=endpoint,
        retries=retries,
        retry_wait_s=retry_wait_s,
        timeout_s=timeout_s,
        stall_timeout_s=stall_timeout_s,
        use_xet=use_xet,
    )
    api = HfApi(endpoint=options.endpoint)
    with hub_session(options, repo_id):
        token = resolve_token(token, api)
    with tempfile.TemporaryDirectory(prefix="slothkit-push-") as scratch:
        folder = pathlib.Path(scratch) / repo_id.rsplit("/", 1)[-1]
        saved = save_pretrained_merged(model, folder, tokenizer, save_method=save_method, **save_kwargs)
        # A deadline of its own: the save's time is not the Hub's.
        with hub_session(options, repo_id) as clock:
            result = _push(api, token, folder, repo_id, private, True, options, clock)
    result.save = saved
    return result
