"""The Jinja bodies of slothkit's chat formats (slothkit.data.chat_formats), one per format.

Each body renders the turns only: `system` is a string or none, `turns` the messages after a
leading system message, and `message[content_key]`, `message[role_key] == user_role` read
the dataset's names; chat_formats.template_source puts the shared prelude (names, default
system text, role checks, BOS) in front. Every assistant reply sits inside
``{% generation %}...{% endgeneration %}`` (the assistant-token masks).
"""

CHATML = r"""
{%- if system is not none -%}
    {{- '<|im_start|>system\n' + system + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {{- '<|im_start|>user\n' + message[content_key] + '<|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- generation -%}
            {{- message[content_key] + '<|im_end|>\n' -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

# Qwen3's: the model writes its reasoning between <think> and </think> before the answer
# of the current exchange (the turns after the last user turn); an answer given there
# without reasoning is rendered with an empty block, as Qwen3's own template renders it,
# and is trained that way. Earlier answers are rendered plain.
QWEN3 = r"""
{%- if system is not none -%}
    {{- '<|im_start|>system\n' + system + '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {{- '<|im_start|>user\n' + message[content_key] + '<|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- generation -%}
            {%- if loop.index0 > ns.last_user and '<think>' not in message[content_key] -%}
                {{- '<think>\n\n</think>\n\n' -}}
            {%- endif -%}
            {{- message[content_key] + '<|im_end|>\n' -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""

# Qwen3's thinking-only models (Qwen3-*-Thinking-2507): the generation prompt opens the
# thinking block itself, so the model writes its reasoning, "</think>" and the answer.  An
# answer after the last user turn is written <think>\n{reasoning}\n</think>\n\n{answer},
# its reasoning what stood before "</think>" in the message (none: an empty block);
# earlier answers keep only what follows their "</think>", as Qwen's own template drops
# the reasoning of past turns.  enable_thinking has no effect.
QWEN3_THINKING = r"""
{%- if system is not none -%}
    {{- '<|im_start|>system\n' + system + '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {{- '<|im_start|>user\n' + message[content_key] + '<|im_end|>\n' -}}
    {%- else -%}
        {%- set answer = message[content_key] -%}
        {%- set reasoning = '' -%}
        {%- if '</think>' in answer -%}
            {%- set reasoning = answer.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
            {%- set answer = answer.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- generation -%}
            {%- if loop.index0 > ns.last_user -%}
                {{- '<think>\n' + reasoning + '\n</think>\n\n' -}}
            {%- endif -%}
            {{- answer + '<|im_end|>\n' -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n<think>\n' -}}
{%- endif -%}
"""

# FastChat's ADD_COLON_TWO style: system + " ", then "USER: u" + " " and
# "ASSISTANT: a" + "</s>"; an open assistant turn is "ASSISTANT:".
VICUNA = r"""
{%- if system -%}
    {{- system + ' ' -}}
{%- endif -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {{- 'USER: ' + message[content_key] + ' ' -}}
    {%- else -%}
        {{- 'ASSISTANT:' -}}
        {%- generation -%}
            {{- ' ' + message[content_key] + eos_token -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- 'ASSISTANT:' -}}
{%- endif -%}
"""

ZEPHYR = r"""
{%- if system is not none -%}
    {{- '<|system|>\n' + system + eos_token + '\n' -}}
{%- endif -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {{- '<|user|>\n' + message[content_key] + eos_token + '\n' -}}
    {%- else -%}
        {{- '<|assistant|>\n' -}}
        {%- generation -%}
            {{- message[content_key] + eos_token + '\n' -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>\n' -}}
{%- endif -%}
"""

# One turn is Stanford Alpaca's prompt exactly ("<preamble>\n\n### Instruction:\n...\n\n
# ### Response:\n") followed by the response and EOS; further turns repeat the two headers.
ALPACA = r"""
{%- if system -%}
    {{- system + '\n\n' -}}
{%- endif -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {{- '### Instruction:\n' + message[content_key] + '\n\n' -}}
    {%- else -%}
        {{- '### Response:\n' -}}
        {%- generation -%}
            {{- message[content_key] + eos_token + '\n\n' -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '### Response:\n' -}}
{%- endif -%}
"""

LLAMA_3 = r"""
{%- if system is not none -%}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' + system | trim + '<|eot_id|>' -}}
{%- endif -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {{- '<|start_header_id|>user<|end_header_id|>\n\n' + message[content_key] | trim + '<|eot_id|>' -}}
    {%- else -%}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {%- generation -%}
            {{- message[content_key] | trim + '<|eot_id|>' -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"""

GEMMA = r"""
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {%- set prefix = system | trim + '\n\n' if loop.first and system else '' -%}
        {{- '<start_of_turn>user\n' + prefix + message[content_key] | trim + '<end_of_turn>\n' -}}
    {%- else -%}
        {{- '<start_of_turn>model\n' -}}
        {%- generation -%}
            {{- message[content_key] | trim + '<end_of_turn>\n' -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\n' -}}
{%- endif -%}
"""

# The prompt of an open assistant turn is the user turn itself: no generation prompt.
MISTRAL = r"""
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {%- set prefix = system + '\n\n' if loop.first and system else '' -%}
        {{- '[INST] ' + prefix + message[content_key] + ' [/INST]' -}}
    {%- else -%}
        {%- generation -%}
            {{- ' ' + message[content_key] + eos_token -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
"""

# Meta's layout: the system text inside the first [INST], every later exchange opened by
# BOS (when the tokenizer has one), each reply followed by " " and EOS.
LLAMA_2 = r"""
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {%- if not loop.first and bos_token -%}
            {{- bos_token -}}
        {%- endif -%}
        {%- set prefix = '<<SYS>>\n' + system + '\n<</SYS>>\n\n' if loop.first and system else '' -%}
        {{- '[INST] ' + prefix + message[content_key] | trim + ' [/INST]' -}}
    {%- else -%}
        {%- generation -%}
            {{- ' ' + message[content_key] | trim + ' ' + eos_token -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
"""

PHI_3 = r"""
{%- if system is not none -%}
    {{- '<|system|>\n' + system + '<|end|>\n' -}}
{%- endif -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {{- '<|user|>\n' + message[content_key] + '<|end|>\n' -}}
    {%- else -%}
        {{- '<|assistant|>\n' -}}
        {%- generation -%}
            {{- message[content_key] + '<|end|>\n' -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>\n' -}}
{%- endif -%}
"""

# Phi-4: ChatML's tokens with <|im_sep|> after the role and no newline anywhere.
PHI_4 = r"""
{%- if system is not none -%}
    {{- '<|im_start|>system<|im_sep|>' + system + '<|im_end|>' -}}
{%- endif -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {{- '<|im_start|>user<|im_sep|>' + message[content_key] + '<|im_end|>' -}}
    {%- else -%}
        {{- '<|im_start|>assistant<|im_sep|>' -}}
        {%- generation -%}
            {{- message[content_key] + '<|im_end|>' -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant<|im_sep|>' -}}
{%- endif -%}
"""

# FastChat's first Vicuna layout (turns "### Human: " and "### Assistant: ", one per line),
# with EOS closing each reply so that generation stops there.
VICUNA_OLD = r"""
{%- if system -%}
    {{- system + '\n' -}}
{%- endif -%}
{%- for message in turns -%}
    {%- if message[role_key] == user_role -%}
        {{- '### Human: ' + message[content_key] + '\n' -}}
    {%- else -%}
        {{- '### Assistant:' -}}
        {%- generation -%}
            {{- ' ' + message[content_key] + eos_token + '\n' -}}
        {%- endgeneration -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '### Assistant:' -}}
{%- endif -%}
"""
