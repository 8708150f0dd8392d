"""The embedded tiny model: the default model of the project, built offline and deterministically.

Nothing here downloads anything. ``ensure_tiny_model()`` builds, once per machine, an ordinary
Hugging Face folder (``AutoModelForCausalLM`` / ``AutoTokenizer`` load it) holding

* a byte-level BPE tokenizer (vocab 1536) trained on a synthetic corpus generated in code
  (arithmetic chats from :mod:`opentinker.environments.arithmetic`, guess-the-number dialogues,
  calculator tool calls, GSM8K-style answers and English from fixed word lists). It uses
  Qwen2's normalizer and pre-tokenizer, because ``AutoTokenizer`` loads any qwen2 folder as
  ``Qwen2Tokenizer`` and rebuilds them; that pre-tokenizer splits digits one per token, which
  is what makes addition learnable. ``<|im_start|>``/``<|im_end|>`` frame chat turns
  (Qwen-style template), ``<|im_end|>`` is the eos token and ``<|endoftext|>`` the pad token;
* a ~1.9M-parameter Qwen2 causal LM, seeded, optionally SFT-warmed on "What is a + b?" until it
  answers a good part of held-out problems right (far from all: GRPO has room to improve it).

Building twice on the same machine gives byte-identical weights and tokenizer files: the builder
fixes seeds, the thread count and deterministic kernels, and restores the caller's settings after.

``python -m opentinker.engine.tiny [--cache-dir DIR] [--force] [--base]`` builds and reports.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from opentinker.environments.arithmetic import (
    HELDOUT_SEED,
    SFT_SEED,
    ArithmeticProblem,
    make_problems,
    score_answer,
)

# Problems that decide when SFT stops: train split, a seed of their own (the arithmetic module's
# seeds are 1-3), so neither the SFT stream nor the held-out evaluation is reused.
VALIDATION_SEED = 4

TINY_MODEL_NAME = "opentinker-tiny-arith"
# Part of the cache folder name: bump it whenever the recipe (corpus, tokenizer, model, SFT)
# changes, so that an old cached build is never mistaken for the new one.
TINY_MODEL_VERSION = "v1"
REPORT_FILE = "opentinker_tiny.json"

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen-style ChatML. All text sits inside {{ }} because transformers renders templates with
# trim_blocks/lstrip_blocks. The {% generation %} block marks what an assistant turn produces
# (content + <|im_end|>), so ``return_assistant_tokens_mask=True`` works.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is not none else '' -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{%- generation -%}{{ content + '<|im_end|>' }}{%- endgeneration -%}"
    "{{ '\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class TinyRecipe:
    """Everything that determines the built folder (together with ``seed``)."""

    vocab_size: int = 1536
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    # SFT warm-up on arithmetic (loss on the answer and <|im_end|> only) ...
    sft_steps: int = 1000  # at most; see stop_at_accuracy
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    # SFT stops as soon as greedy accuracy on ``stop_check_problems`` validation problems (train
    # split, their own seed) reaches ``stop_at_accuracy``: learning addition goes from ~5% to ~90%
    # within a few dozen steps, and stopping on a measurement (rather than at a fixed step) lands
    # in the middle of that jump on any CPU. Checks start once the running loss is below
    # ``stop_check_below_loss`` and then run every ``stop_check_every`` steps.
    stop_at_accuracy: float = 0.4
    stop_check_problems: int = 100
    stop_check_every: int = 10
    stop_check_below_loss: float = 1.0
    # ... with a small language-model batch of English chats every ``english_every`` steps.
    english_every: int = 4
    english_batch_size: int = 16
    threads: int = 2
    eval_problems: int = 200


DEFAULT_RECIPE = TinyRecipe()


# --------------------------------------------------------------------------------------------
# Cache location and the public entry point
# --------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$OPENTINKER_CACHE_DIR``, else ``$XDG_CACHE_HOME/opentinker``, else ``~/.cache/opentinker``."""
    explicit = os.environ.get("OPENTINKER_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "opentinker"
    return Path.home() / ".cache" / "opentinker"


def tiny_model_dir(cache_dir: str | os.PathLike | None = None, *, warm: bool = True) -> Path:
    """Where the (warm or base) tiny model lives in ``cache_dir``; it may not be built yet."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    suffix = "" if warm else "-base"
    return root / f"{TINY_MODEL_NAME}-{TINY_MODEL_VERSION}{suffix}"


def _is_complete(folder: Path) -> bool:
    # The report is written last inside the temporary folder, and the folder only appears
    # under its final name by an atomic rename, so its presence means a finished build.
    return (folder / REPORT_FILE).is_file() and (folder / "model.safetensors").is_file()


@contextlib.contextmanager
def _build_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock (fcntl.flock); a no-op where fcntl does not exist."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def ensure_tiny_model(
    cache_dir: str | os.PathLike | None = None,
    *,
    warm: bool = True,
    progress: bool = True,
    force: bool = False,
) -> Path:
    """The folder of the tiny model (SFT-warmed when ``warm``, else random init), built once.

    Concurrent callers (threads or processes) are serialized by a lock file; the build goes to a
    temporary folder beside the final one and is renamed into place, so a reader never sees a
    half-written model. ``force`` rebuilds even when a finished build is there.
    """
    target = tiny_model_dir(cache_dir, warm=warm)
    if _is_complete(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target) and not force:
            return target  # another process built it while we waited for the lock
        # Builders hold the lock, so staging folders seen now were left by a killed build.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if progress:
            kind = "SFT-warmed" if warm else "base (random init)"
            print(f"[opentinker.tiny] building the {kind} tiny model into {target}", file=sys.stderr)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build_tiny_model(staging, sft_steps=None if warm else 0, progress=progress)
            os.chmod(staging, 0o755)  # mkdtemp makes it private; the cache is an ordinary folder
            if target.exists():  # stale, incomplete or forced: move it aside, then swap in
                trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
                os.replace(target, trash / "old")
                os.replace(staging, target)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(staging, target)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return target


def read_tiny_report(folder: str | os.PathLike) -> dict[str, Any]:
    """The build report (recipe, parameter count, build seconds, accuracies) of a built folder."""
    return json.loads((Path(folder) / REPORT_FILE).read_text())


# --------------------------------------------------------------------------------------------
# Synthetic corpus (pure Python, seeded)
# --------------------------------------------------------------------------------------------

_NAMES = ["Tom", "Anna", "Sam", "Mia", "Leo", "Zoe", "Ben", "Lily", "Max", "Emma", "Noah", "Ava"]
_ITEMS = ["apples", "pencils", "books", "cookies", "marbles", "stickers", "coins", "flowers",
          "cards", "stamps", "shells", "toys"]
_ADJECTIVES = ["small", "large", "quick", "quiet", "bright", "dark", "happy", "old", "new",
               "green", "red", "blue", "warm", "cold", "simple", "careful", "strong", "gentle"]
_NOUNS = ["dog", "cat", "bird", "tree", "river", "city", "house", "garden", "teacher", "student",
          "friend", "car", "train", "book", "song", "game", "number", "answer", "question",
          "problem", "model", "story", "window", "table", "road", "sun", "moon", "child"]
_VERBS = ["sees", "likes", "finds", "makes", "reads", "writes", "helps", "takes", "gives",
          "knows", "wants", "opens", "follows", "builds", "counts", "checks", "solves", "plays"]
_PLACES = ["in the park", "at school", "near the river", "in the kitchen", "on the road",
           "at home", "in the garden", "by the window", "in the city", "after lunch"]
_CONNECTIVES = ["Then", "Later", "After that", "Today", "Every morning", "Once", "Sometimes"]
_ASSISTANT_OPENERS = ["Sure.", "Of course.", "Here is one.", "Okay.", "Let me think."]
# A few hundred common English words, for plain text the later text games and tools will use.
_COMMON_WORDS = """
the of and to a in is it you that he was for on are with as his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her long
make thing see him two has look more day could go come did number sound no most people my over
know water than call first who may down side been now find any new work part take get place made
live where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food sun
four between state keep eye never last let thought city cross farm hard start might story saw far
sea draw left late run while press close night real life few north open seem together next white
children begin got walk example ease paper group always music those both mark often letter until
mile river car feet care second book carry took science eat room friend began idea fish mountain
stop once base hear horse cut sure watch color face wood main enough plain girl usual young ready
above ever red list though feel talk bird soon body dog family direct pose leave song measure door
product black short numeral class wind question happen complete ship area half rock order fire
south piece told knew pass since top whole king space heard best hour better true during hundred
five remember step early hold west ground interest reach fast verb sing listen six table travel
less morning ten simple several vowel toward war lay against pattern slow center love person money
serve appear road map rain rule govern pull cold notice voice unit power town fine certain fly fall
lead cry dark machine note wait plan figure star box noun field rest correct able pound done beauty
drive stood contain front teach week final gave green oh quick develop ocean warm free minute
strong special mind behind clear tail produce fact street inch multiply nothing course stay wheel
full force blue object decide surface deep moon island foot system busy test record boat common
gold possible plane stead dry wonder laugh thousand ago ran check game shape equate miss brought
heat snow tire bring yes distant fill east paint language among
""".split()
_TOPIC_REQUESTS = ["Tell me something about the {noun}.", "Write a sentence about a {noun}.",
                   "Describe a {adj} {noun}.", "Say something nice.", "Tell me a short story."]


def _sentence(rng: random.Random) -> str:
    subject = f"The {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    obj = f"a {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    body = f"{subject} {rng.choice(_VERBS)} {obj} {rng.choice(_PLACES)}."
    if rng.random() < 0.3:
        body = f"{rng.choice(_CONNECTIVES)}, {body[0].lower()}{body[1:]}"
    return body


def _plain_text(rng: random.Random, words: int) -> str:
    """Loosely English text: common words with capitals, commas and full stops."""
    out, start = [], True
    for _ in range(words):
        word = rng.choice(_COMMON_WORDS)
        out.append(word.capitalize() if start else word)
        start = rng.random() < 0.12
        if start:
            out[-1] += "."
        elif rng.random() < 0.05:
            out[-1] += ","
    return " ".join(out) + ("" if start else ".")


def _english_chat(rng: random.Random) -> list[dict[str, str]]:
    request = rng.choice(_TOPIC_REQUESTS).format(noun=rng.choice(_NOUNS), adj=rng.choice(_ADJECTIVES))
    reply = " ".join([rng.choice(_ASSISTANT_OPENERS)] + [_sentence(rng) for _ in range(rng.randint(1, 3))])
    return [{"role": "user", "content": request}, {"role": "assistant", "content": reply}]


def _guess_the_number_chat(rng: random.Random) -> list[dict[str, str]]:
    secret = rng.randint(1, 100)
    low, high = 1, 100
    messages = [
        {"role": "system", "content": "You are playing a guessing game. Reply with a number."},
        {"role": "user", "content": "Guess a number between 1 and 100."},
    ]
    for _ in range(8):
        guess = (low + high) // 2 if rng.random() < 0.7 else rng.randint(low, high)
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            messages.append({"role": "user", "content": "Correct! You found the number."})
            break
        if guess > secret:
            high = guess - 1
            messages.append({"role": "user", "content": "Too high. Guess again."})
        else:
            low = guess + 1
            messages.append({"role": "user", "content": "Too low. Guess again."})
    return messages


def _calculator_chat(rng: random.Random) -> list[dict[str, str]]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    word = {"+": "plus", "-": "minus", "*": "times"}[op]
    return [
        {"role": "system", "content": "You can use the calc tool to do arithmetic."},
        {"role": "user", "content": f"What is {a} {word} {b}?"},
        {"role": "assistant", "content": f"<tool_call>calc({a}{op}{b})</tool_call>"},
        {"role": "tool", "content": f"<tool_response>{value}</tool_response>"},
        {"role": "assistant", "content": f"The answer is {value}."},
    ]


def _word_problem_chat(rng: random.Random) -> list[dict[str, str]]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    have, more = rng.randint(2, 30), rng.randint(2, 30)
    if rng.random() < 0.5:
        question = (f"{name} has {have} {item}. {name} buys {more} more {item}. "
                    f"How many {item} does {name} have now?")
        reasoning = f"{name} starts with {have} {item} and buys {more} more, so {have} + {more} = {have + more}."
        answer = have + more
    else:
        total = have + more
        question = (f"{name} has {total} {item} and gives {more} of them to a friend. "
                    f"How many {item} are left?")
        reasoning = f"{name} has {total} {item} and gives away {more}, so {total} - {more} = {have}."
        answer = have
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": f"{reasoning}\n#### {answer}"},
    ]


_CHAT_MAKERS = (_english_chat, _guess_the_number_chat, _calculator_chat, _word_problem_chat)


def english_chats(count: int, seed: int) -> list[list[dict[str, str]]]:
    """``count`` non-arithmetic chats (stories, guessing game, tool calls, word problems)."""
    rng = random.Random(f"opentinker-tiny-english-{seed}")
    return [_CHAT_MAKERS[i % len(_CHAT_MAKERS)](rng) for i in range(count)]


def render_chat(messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat template in plain Python (used before a tokenizer exists; tests check they agree)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content'] or ''}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def tokenizer_corpus() -> list[str]:
    """The text the BPE is trained on: fixed, independent of the build seed."""
    rng = random.Random("opentinker-tiny-corpus")
    texts = []
    for problem in make_problems(3000, SFT_SEED, "train"):
        texts.append(render_chat(problem.messages() + [{"role": "assistant", "content": problem.answer}]))
    texts += [render_chat(chat) for chat in english_chats(4000, seed=12345)]
    texts += [" ".join(_sentence(rng) for _ in range(5)) for _ in range(2000)]
    texts += [_plain_text(rng, 60) for _ in range(2000)]
    # Every word of the lists at least a few times, in several casings, so they become tokens.
    words = _NAMES + _ITEMS + _ADJECTIVES + _NOUNS + _VERBS + _CONNECTIVES + _COMMON_WORDS
    texts += [" ".join(words), " ".join(w.capitalize() for w in words), "\n".join(words)] * 3
    return texts


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


# Qwen2's pre-tokenizer regex (transformers' ``Qwen2Tokenizer``). Its ``\p{N}`` alternative
# isolates every digit, so numbers are always split one digit per token.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def _qwen2_pipeline(backend) -> None:
    """Normalizer, pre-tokenizer and decoder exactly as ``Qwen2Tokenizer`` builds them.

    ``AutoTokenizer`` always loads a ``model_type == "qwen2"`` folder as ``Qwen2Tokenizer``, which
    rebuilds this pipeline around the saved vocab and merges (ignoring the one in tokenizer.json).
    Training the BPE with that very pipeline keeps the saved file, the in-process tokenizer and
    what ``AutoTokenizer`` returns identical. (NFC normalization means text round-trips exactly
    when it is NFC, as nearly all text is.)
    """
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()


def build_tokenizer(vocab_size: int = DEFAULT_RECIPE.vocab_size):
    """A byte-level BPE trained on :func:`tokenizer_corpus`, as a ``PreTrainedTokenizerFast``.

    ``<|endoftext|>`` (id 0, pad), ``<|im_start|>`` (1) and ``<|im_end|>`` (2, eos) are special
    tokens; the chat template is :data:`CHAT_TEMPLATE`.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    _qwen2_pipeline(backend)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(tokenizer_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=DEFAULT_RECIPE.max_position_embeddings,
        padding_side="right",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def _save_and_reload_tokenizer(tokenizer, config, out: Path):
    """Save, then load back with ``AutoTokenizer`` next to ``config``: the SFT then runs with
    exactly the tokenizer class (``Qwen2Tokenizer``) that users of the folder get."""
    from transformers import AutoTokenizer

    tokenizer.save_pretrained(out)
    # Name the class AutoTokenizer picks anyway for a qwen2 folder, so the file says what loads.
    tokenizer_config = out / "tokenizer_config.json"
    fields = json.loads(tokenizer_config.read_text())
    fields["tokenizer_class"] = "Qwen2Tokenizer"
    tokenizer_config.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
    config.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def make_config(tokenizer, recipe: TinyRecipe = DEFAULT_RECIPE):
    from transformers import Qwen2Config

    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        rope_theta=recipe.rope_theta,
        tie_word_embeddings=True,
        use_cache=True,
        bos_token_id=pad_id,  # as Qwen2: <|endoftext|> doubles as bos; the tokenizer adds none
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )


@contextlib.contextmanager
def _deterministic_torch(threads: int, seed: int) -> Iterator[None]:
    """Fixed threads, deterministic kernels and a forked RNG; the caller's state comes back after."""
    import torch

    old_threads = torch.get_num_threads()
    old_deterministic = torch.are_deterministic_algorithms_enabled()
    old_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_deterministic, warn_only=old_warn_only)


@contextlib.contextmanager
def _quiet_transformers_progress() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------------------------
# SFT warm-up
# --------------------------------------------------------------------------------------------


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _prompt_text(tokenizer, messages: Sequence[dict[str, str]]) -> str:
    """The chat rendered by the tokenizer's own template, ready for the assistant to answer."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return render_chat(messages, add_generation_prompt=True)


class _ArithmeticEncoder:
    """Token ids of prompt and answer, memoized per problem (there are only 10,000)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.convert_tokens_to_ids(IM_END)
        self._cache: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def __call__(self, problem: ArithmeticProblem) -> tuple[list[int], list[int]]:
        key = (problem.a, problem.b)
        if key not in self._cache:
            prompt = _encode(self.tokenizer, _prompt_text(self.tokenizer, problem.messages()))
            answer = _encode(self.tokenizer, problem.answer) + [self.eos_id]
            self._cache[key] = (prompt, answer)
        return self._cache[key]


def _pad_batch(rows: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 where no loss)."""
    import torch

    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for i, (ids, loss_mask) in enumerate(rows):
        n = len(ids)
        input_ids[i, :n] = torch.tensor(ids)
        attention_mask[i, :n] = 1
        labels[i, :n] = torch.tensor([t if m else -100 for t, m in zip(ids, loss_mask)])
    return input_ids, attention_mask, labels


def _masked_lm_loss(model, input_ids, attention_mask, labels):
    """Next-token cross-entropy where ``labels`` != -100, with the LM head applied only there.

    Same value as ``model(..., labels=labels).loss``; an arithmetic chat has ~4 loss positions out
    of ~22, so skipping the rest of the (vocab-sized) head saves a good part of the step.
    """
    import torch.nn.functional as F

    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    logits = model.get_output_embeddings()(hidden[:, :-1][keep])
    return F.cross_entropy(logits.float(), targets[keep])


@dataclass
class _SftResult:
    losses: list[float]
    steps_run: int
    validation_accuracy: float | None  # at the last check; None when never checked


def _sft(
    model, tokenizer, recipe: TinyRecipe, steps: int, seed: int, progress: bool, on_step=None
) -> _SftResult:
    """AdamW on arithmetic chats (loss on answer + <|im_end|>) plus a little English LM loss.

    Runs ``steps`` steps at most and stops early once validation accuracy reaches
    ``recipe.stop_at_accuracy`` (see :class:`TinyRecipe`).
    """
    import torch
    from tqdm.auto import tqdm

    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    encode_problem = _ArithmeticEncoder(tokenizer)
    # Both streams are prefix-stable: the first N steps see the same data whatever ``steps`` is.
    problems = make_problems(steps * recipe.batch_size, SFT_SEED, "train")
    n_english = (steps // recipe.english_every + 1) * recipe.english_batch_size
    english = [
        _encode(tokenizer, tokenizer.apply_chat_template(chat, tokenize=False))
        for chat in english_chats(n_english, seed)
    ]
    english = [ids[: recipe.max_position_embeddings] for ids in english]

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.learning_rate,
        betas=(0.9, 0.98),
        eps=1e-8,
    )

    def lr_at(step: int) -> float:  # linear warm-up, then constant (training stops early)
        return recipe.learning_rate * min(1.0, (step + 1) / recipe.warmup_steps)

    validation = make_problems(recipe.stop_check_problems, VALIDATION_SEED, "train")
    validation_accuracy: float | None = None

    model.train()
    losses: list[float] = []
    bar = tqdm(range(steps), desc="tiny SFT", disable=not progress, file=sys.stderr, mininterval=2.0)
    english_cursor = 0
    for step in bar:
        rows = []
        for problem in problems[step * recipe.batch_size : (step + 1) * recipe.batch_size]:
            prompt, answer = encode_problem(problem)
            rows.append((prompt + answer, [False] * len(prompt) + [True] * len(answer)))
        input_ids, attention_mask, labels = _pad_batch(rows, pad_id)
        loss = _masked_lm_loss(model, input_ids, attention_mask, labels)
        if recipe.english_every and step % recipe.english_every == 0:
            batch = english[english_cursor : english_cursor + recipe.english_batch_size]
            english_cursor += recipe.english_batch_size
            e_ids, e_mask, e_labels = _pad_batch([(ids, [True] * len(ids)) for ids in batch], pad_id)
            lm_loss = _masked_lm_loss(model, e_ids, e_mask, e_labels)
            total = loss + 0.5 * lm_loss
        else:
            total = loss
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, model)
        running_loss = sum(losses[-10:]) / len(losses[-10:])
        if (step + 1) % recipe.stop_check_every == 0 and running_loss < recipe.stop_check_below_loss:
            validation_accuracy = evaluate_arithmetic(model, tokenizer, validation, max_new_tokens=5)
            model.train()
            if validation_accuracy >= recipe.stop_at_accuracy:
                bar.set_postfix(loss=f"{running_loss:.3f}", val_acc=f"{validation_accuracy:.2f}")
                break
        if step % 10 == 0:
            postfix = {"loss": f"{running_loss:.3f}"}
            if validation_accuracy is not None:
                postfix["val_acc"] = f"{validation_accuracy:.2f}"
            bar.set_postfix(postfix)
    bar.close()
    model.eval()
    return _SftResult(losses, len(losses), validation_accuracy)


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


def evaluate_arithmetic(
    model,
    tokenizer,
    problems: Sequence[ArithmeticProblem],
    temperature: float = 0.0,
    seed: int = 0,
    *,
    batch_size: int = 128,
    max_new_tokens: int = 8,
) -> float:
    """Fraction of ``problems`` answered right by ``model.generate`` (greedy when temperature is 0).

    Prompts are the chat template with the generation prompt, left-padded in batches; a response
    is scored by :func:`score_answer` (first integer of the decoded text).
    """
    import torch

    if not problems:
        return 0.0
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0.0
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(seed)
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            prompts = [_encode(tokenizer, _prompt_text(tokenizer, p.messages())) for p in chunk]
            width = max(len(p) for p in prompts)
            input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, ids in enumerate(prompts):
                input_ids[i, width - len(ids) :] = torch.tensor(ids)
                attention_mask[i, width - len(ids) :] = 1
            sampling: dict[str, Any] = (
                {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                if temperature > 0
                else {"do_sample": False}
            )
            output = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_id,
                eos_token_id=eos_id,
                **sampling,
            )
            for problem, row in zip(chunk, output[:, width:].tolist()):
                text = tokenizer.decode(row, skip_special_tokens=True)
                correct += score_answer(text, problem.answer)
    model.train(was_training)
    return correct / len(problems)


# --------------------------------------------------------------------------------------------
# The builder
# --------------------------------------------------------------------------------------------


def build_tiny_model(
    out_dir: str | os.PathLike,
    *,
    sft_steps: int | None = None,
    seed: int = 0,
    progress: bool = True,
    recipe: TinyRecipe = DEFAULT_RECIPE,
) -> dict[str, Any]:
    """Build tokenizer + model (+ SFT warm-up for ``sft_steps``, default the recipe's) into ``out_dir``.

    Returns the report that is also written to ``out_dir/opentinker_tiny.json``. ``sft_steps=0``
    gives the random-init base model. Same arguments on the same machine give byte-identical
    ``model.safetensors`` and tokenizer files.
    """
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    started = time.perf_counter()
    steps = recipe.sft_steps if sft_steps is None else int(sft_steps)
    recipe = replace(recipe, sft_steps=steps)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def say(message: str) -> None:
        if progress:
            print(f"[opentinker.tiny] {message}", file=sys.stderr, flush=True)

    with _deterministic_torch(recipe.threads, seed):
        say("training the byte-level BPE tokenizer on the synthetic corpus")
        trained = build_tokenizer(recipe.vocab_size)
        config = make_config(trained, recipe)
        tokenizer = _save_and_reload_tokenizer(trained, config, out)
        model = Qwen2ForCausalLM(config).to(torch.float32)
        n_params = sum(p.numel() for p in model.parameters())
        say(f"model: Qwen2, {n_params:,} parameters, vocab {len(tokenizer)}")

        sft = _SftResult([], 0, None)
        sft_seconds = 0.0
        if steps > 0:
            say(f"SFT warm-up: at most {steps} steps of {recipe.batch_size} arithmetic chats, until "
                f"validation accuracy reaches {recipe.stop_at_accuracy:.0%}")
            sft_started = time.perf_counter()
            sft = _sft(model, tokenizer, recipe, steps, seed, progress)
            sft_seconds = time.perf_counter() - sft_started
        losses = sft.losses
        model.eval()

        heldout = make_problems(recipe.eval_problems, HELDOUT_SEED, "heldout")
        say(f"evaluating on {len(heldout)} held-out problems")
        greedy = evaluate_arithmetic(model, tokenizer, heldout, temperature=0.0)
        sampled = evaluate_arithmetic(model, tokenizer, heldout, temperature=1.0, seed=seed)

        model.generation_config = GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=64,
        )
        with _quiet_transformers_progress():  # a one-shard "Writing model shards" bar is noise
            model.save_pretrained(out)

    report = {
        "name": TINY_MODEL_NAME,
        "version": TINY_MODEL_VERSION,
        "warm": sft.steps_run > 0,
        "seed": seed,
        "recipe": asdict(recipe),
        "num_parameters": n_params,
        "vocab_size": len(tokenizer),
        "sft_max_steps": steps,
        "sft_steps": sft.steps_run,
        "sft_validation_accuracy": sft.validation_accuracy,
        "sft_final_loss": (sum(losses[-20:]) / len(losses[-20:])) if losses else None,
        "heldout_problems": len(heldout),
        "heldout_greedy_accuracy": greedy,
        "heldout_sampled_accuracy": sampled,
        "sft_seconds": round(sft_seconds, 2),
        "build_seconds": round(time.perf_counter() - started, 2),
        "built_at": time.time(),
        "build_id": os.urandom(8).hex(),  # differs on every build: evidence of (no) rebuild
        "torch_version": torch.__version__,
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    say(f"held-out accuracy: greedy {greedy:.3f}, sampled (T=1) {sampled:.3f}; "
        f"built in {report['build_seconds']:.1f}s")
    return report


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m opentinker.engine.tiny",
        description="Build (once) the embedded tiny model and print where it is and its accuracy.",
    )
    parser.add_argument("--cache-dir", default=None, help="default: $OPENTINKER_CACHE_DIR, "
                        "$XDG_CACHE_HOME/opentinker or ~/.cache/opentinker")
    parser.add_argument("--force", action="store_true", help="rebuild even when already built")
    parser.add_argument("--base", action="store_true", help="the random-init model (no SFT warm-up)")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    folder = ensure_tiny_model(args.cache_dir, warm=not args.base, progress=not args.quiet, force=args.force)
    report = read_tiny_report(folder)
    print(folder)
    print(
        f"{report['name']} {report['version']} ({'warm' if report['warm'] else 'base'}): "
        f"{report['num_parameters']:,} parameters, vocab {report['vocab_size']}, "
        f"held-out accuracy greedy {report['heldout_greedy_accuracy']:.3f} / "
        f"sampled {report['heldout_sampled_accuracy']:.3f} "
        f"on {report['heldout_problems']} problems, built in {report['build_seconds']:.1f}s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
