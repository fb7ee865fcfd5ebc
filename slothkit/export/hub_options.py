"""How a push talks to the Hub: the options every push takes, as one value.

    options = HubOptions(retries=4, stall_timeout_s=600)

The public pushes (push_to_hub_merged, push_folder_to_hub, the model methods) keep these as
keywords and build one HubOptions; every layer below them (hub.hub_session, hub_client,
the upload and its retries) takes that value.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HubOptions:
    """The Hub options of one push.

    Args:
        commit_message: the commit's message; None: the push's own ("Upload ... with slothkit").
        endpoint: another Hub's URL; None: HF_ENDPOINT or huggingface.co.
        retries: how many times a transient failure (network, HTTP 5xx, 408, 429) is retried.
        retry_wait_s: the pause before the first retry in seconds, doubled at each.
        timeout_s: seconds to wait for the server to answer a read or accept a write before
            the attempt counts as failed; None: wait forever.
        stall_timeout_s: seconds the push may go without a byte sent to or received from the
            Hub, across every request and retry (slothkit.export.hub_client); None: no limit.
        use_xet: upload large files through Xet (hf_xet) where huggingface_hub would, outside
            timeout_s and stall_timeout_s; False: through the Hub's LFS API
            (slothkit.export.hub_transfers).

    Raises:
        ValueError: stall_timeout_s is not a positive number of seconds nor None.
    """

    commit_message: str | None = None
    endpoint: str | None = None
    retries: int = 2
    retry_wait_s: float = 2.0
    # Any one read or write may wait a minute; the whole push gives up after three minutes
    # without a byte moving, room for two stalled tries and huggingface_hub's pauses.
    timeout_s: float | None = 60.0
    stall_timeout_s: float | None = 180.0
    use_xet: bool = False

    def __post_init__(self):
        if self.stall_timeout_s is not None and not self.stall_timeout_s > 0:
            raise ValueError(
                f"stall_timeout_s={self.stall_timeout_s!r}: expected a positive number of seconds, "
                "or None for no limit"
            )
