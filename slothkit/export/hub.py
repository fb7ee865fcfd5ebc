"""Publishing to the Hugging Face Hub: one atomic commit per push, safe to retry.

A push is one `upload_folder` call, which the Hub applies as a single commit: either every
file of the export appears in the repo or none does. Retrying after a failure is idempotent:

- large files already uploaded by the failed attempt are skipped (the LFS/Xet store already
  has their hash), and never visible in the repo on their own;
- files whose content is already in the repo are dropped from the commit by the client, so a
  retry after a commit that did land (but whose reply was lost) creates no second commit;
- files of an earlier export that the new one does not contain (say, an adapter's
  adapter_config.json when a merged model is pushed to the same repo) are deleted in the
  same commit, so the repo holds exactly one model (MODEL_FILE_PATTERNS; other files stay).

Transient failures (connection errors, HTTP 5xx, 408, 429) are retried here a few times with
a growing pause; authentication problems are reported with how to log in.  huggingface_hub's
HTTP client waits forever by default, so a server that stops answering mid-upload would
hang the push: while slothkit pushes, every client huggingface_hub builds gets connect and
read timeouts (`timeout_s`, hub_timeouts), and a push that still fails ends in
HubConnectionError naming the URL and the cause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import tempfile
import time

from torch import nn

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

_TRANSIENT_STATUS = {408, 429}
_NETWORK_ERROR_NAMES = {
    "ConnectError", "ConnectTimeout", "ReadError", "ReadTimeout", "WriteError", "WriteTimeout",
    "PoolTimeout", "RemoteProtocolError", "NetworkError", "TimeoutException", "ConnectionError",
}  # fmt: skip


CONNECT_TIMEOUT_S = 10.0


class HubAuthError(PermissionError):
    """No usable Hugging Face token: missing, invalid, read-only, or without access to the repo."""


class HubConnectionError(ConnectionError):
    """The Hub did not answer (in time, or at all), or kept failing, after the retries."""


def _request_url(error: BaseException) -> str | None:
    for cause in _causes(error):
        for holder in (cause, getattr(cause, "response", None)):
            try:  # httpx raises RuntimeError for an error without a request
                request = getattr(holder, "request", None)
            except RuntimeError:
                request = None
            url = getattr(request, "url", None)
            if url is not None:
                return str(url)
    return None


def _cause_text(error: BaseException) -> str:
    """The network error behind `error` as 'TypeName: message', or its HTTP status."""
    causes = list(_causes(error))
    status = next((s for s in map(_status_of, causes) if s is not None), None)
    network = [c for c in causes if any(cls.__name__ in _NETWORK_ERROR_NAMES for cls in type(c).__mro__)]
    cause = network[0] if network else causes[-1]
    # httpx's status errors add a second line (a link to MDN's page on the status): one line.
    first_line = next(iter(str(cause).strip().splitlines()), "")
    text = f"{type(cause).__name__}: {first_line}".rstrip(": ")
    if "Timeout" in type(cause).__name__ or isinstance(cause, TimeoutError):
        text += " (the server stopped answering)"
    return f"HTTP {status} ({text})" if status is not None else text


def connection_error(error: BaseException, what: str, fallback_url: str, attempts: int) -> HubConnectionError:
    """A HubConnectionError for a Hub request that failed: what was tried, the URL, the cause."""
    url = _request_url(error) or fallback_url
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    return HubConnectionError(f"{what} failed{tries}: {url}: {_cause_text(error)}")


@contextlib.contextmanager
def hub_timeouts(timeout_s: float | None):
    """Give every HTTP client huggingface_hub uses in the block connect and read timeouts.

    Its default client has none, so a server that accepts a request and never answers
    hangs the caller.  Setting them on the shared client alone is not enough: after a
    connection error huggingface_hub closes that client and builds a new one from its
    client factory.  So the factory is wrapped for the block
    (``huggingface_hub.set_client_factory``, which also drops the current client): each
    client built in the block, the first one included, gets the timeouts.  The factory
    is put back afterwards (a user's own factory, proxies and all, is the one wrapped).

    Args:
        timeout_s: seconds to wait for any read or write (the connect timeout is the
            smaller of this and CONNECT_TIMEOUT_S); None: no change.
    """
    if timeout_s is None:
        yield
        return
    import huggingface_hub
    from huggingface_hub.utils import _http

    # The factory in use has no public getter; the default stands in where it is missing.
    factory = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)
    timeout = type(huggingface_hub.get_session().timeout)(
        timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S)
    )

    def factory_with_timeouts():
        client = factory()
        client.timeout = timeout
        return client

    huggingface_hub.set_client_factory(factory_with_timeouts)
    try:
        yield
    finally:
        huggingface_hub.set_client_factory(factory)


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


def _upload(api, folder: pathlib.Path, repo_id: str, token: str, commit_message: str,
            replace_model_files: bool, retries: int, retry_wait_s: float):  # fmt: skip
    for attempt in range(retries + 1):
        try:
            return api.upload_folder(
                repo_id=repo_id,
                folder_path=str(folder),
                repo_type="model",
                token=token,
                commit_message=commit_message,
                delete_patterns=list(MODEL_FILE_PATTERNS) if replace_model_files else None,
            )
        except Exception as error:
            auth_error = _auth_error_or_none(error, repo_id)
            if auth_error is not None:
                raise auth_error from error
            if not is_transient(error):
                raise
            if attempt == retries:
                url = f"{api.endpoint}/{repo_id}"
                raise connection_error(error, f"uploading {folder} to {repo_id}", url, attempt + 1) from error
            time.sleep(retry_wait_s * 2**attempt)
    raise AssertionError("unreachable")


def _push(api, token: str, folder: pathlib.Path, repo_id: str, private: bool, commit_message: str,
          replace_model_files: bool, retries: int, retry_wait_s: float) -> PushResult:  # fmt: skip
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
    info = _upload(api, folder, repo_id, token, commit_message, replace_model_files, retries, retry_wait_s)
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    return PushResult(repo_id=repo_id, commit_oid=info.oid, commit_url=info.commit_url, files=files)


def push_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    token: str | None = None,
    private: bool = False,
    *,
    commit_message: str | None = None,
    endpoint: str | None = None,
    replace_model_files: bool = True,
    retries: int = 2,
    retry_wait_s: float = 2.0,
    timeout_s: float | None = 60.0,
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

    Raises:
        HubAuthError: no usable token.
        HubConnectionError: the Hub did not answer, or kept failing, after the retries;
            the message names the URL and the cause.
    """
    from huggingface_hub import HfApi

    folder = pathlib.Path(folder)
    if not folder.is_dir() or not any(folder.iterdir()):
        raise FileNotFoundError(f"{str(folder)!r} is not a non-empty folder; nothing to push")
    api = HfApi(endpoint=endpoint)
    with hub_timeouts(timeout_s):
        token = resolve_token(token, api)
        message = commit_message or f"Upload {folder.name} with slothkit"
        return _push(
            api, token, folder, repo_id, private, message, replace_model_files, retries, retry_wait_s
        )


def push_to_hub_merged(
    model: nn.Module,
    repo_id: str,
    tokenizer=None,
    save_method: str = "merged_16bit",
    token: str | None = None,
    private: bool = False,
    *,
    commit_message: str | None = None,
    endpoint: str | None = None,
    retries: int = 2,
    retry_wait_s: float = 2.0,
    timeout_s: float | None = 60.0,
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
        **save_kwargs: passed to ``save_pretrained_merged``: base_weights,
            max_shard_size, dtype, training_settings.

    Returns:
        A ``PushResult``: the repo id, the commit's id and URL, the files uploaded, and
        the ``SaveResult`` of the save.

    Raises:
        HubAuthError: no token, or one that is invalid, read-only or without access to
            the repo; the message says how to log in.
        ConnectionError: HF_HUB_OFFLINE is set; HubConnectionError (a ConnectionError):
            the Hub did not answer, or kept failing, after the retries.
        ValueError: an unknown save_method, or another error of the save.
    """
    from huggingface_hub import HfApi

    check_save_method(save_method)
    api = HfApi(endpoint=endpoint)
    with hub_timeouts(timeout_s):
        token = resolve_token(token, api)
    with tempfile.TemporaryDirectory(prefix="slothkit-push-") as scratch:
        folder = pathlib.Path(scratch) / repo_id.rsplit("/", 1)[-1]
        saved = save_pretrained_merged(model, folder, tokenizer, save_method=save_method, **save_kwargs)
        message = commit_message or f"Upload {save_method} model with slothkit"
        with hub_timeouts(timeout_s):
            result = _push(api, token, folder, repo_id, private, message, True, retries, retry_wait_s)
    result.save = saved
    return result
