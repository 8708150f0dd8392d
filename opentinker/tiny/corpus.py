"""The synthetic corpus (pure Python, seeded): arithmetic, guess-the-number and calculator
chats, GSM8K-style answers and English from fixed word lists."""

from __future__ import annotations

import random
from collections.abc import Sequence

from opentinker.environments.arithmetic import SFT_SEED, make_problems
from opentinker.tiny.recipe import IM_END, IM_START

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
