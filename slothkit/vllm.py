"""The vLLM names Unsloth's notebooks import, for ``model.fast_generate``:

    from vllm import SamplingParams                 ->  from slothkit.vllm import SamplingParams
    from vllm.lora.request import LoRARequest       ->  from slothkit.vllm import LoRARequest

slothkit decodes without vLLM (slothkit.inference.vllm_generate); what each setting means:
slothkit.compat.sampling_params.
"""

from slothkit.compat.sampling_params import SamplingParams
from slothkit.inference.vllm_generate import CompletionOutput, LoRARequest, RequestOutput

__all__ = ["CompletionOutput", "LoRARequest", "RequestOutput", "SamplingParams"]
