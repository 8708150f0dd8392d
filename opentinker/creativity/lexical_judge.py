"""A strategy judge without any model: responses are grouped by the words they use.

This is an approximation. It stands in for "solution strategy" with vocabulary: two responses
that describe the same method mostly share their content words and word pairs ("add the tens",
"count up from"), while a different method shows up as different words. It cannot tell two
approaches apart that are described with the same words, and it splits paraphrases that share
almost no words. Use it where no judge model or API is available (CI, laptops, air-gapped
machines) or as a cheap baseline; prefer the ``openai`` or ``hf`` judge for real runs.

How a group is labelled (deterministic; scikit-learn, which the ``server`` extra installs):

1. Tokens: lowercase words, arithmetic symbols (``+ - * / = ^ % < >`` and ``×``, ``÷``, ``√``)
   and numbers; every number becomes one placeholder ``<num>``, so ``7 + 8 = 15`` and
   ``7 + 8 = 16`` (an arithmetic slip) look the same. A short list of English function words is
   dropped.
2. Features: unigrams and bigrams of the words, and separately of the arithmetic tokens;
   scikit-learn's ``TfidfVectorizer`` with sublinear term frequency ``1 + log(tf)`` times a
   smoothed inverse document frequency over the responses of the group
   (``log((1 + n) / (1 + df)) + 1``); arithmetic grams are scaled by
   ``math_weight`` (default 0.2), then each vector is L2-normalized. Arithmetic is down-weighted
   because nearly every math solution is full of ``<num> + <num> = <num>``: at full weight it
   made unrelated methods look alike. Responses made only of arithmetic are still compared by
   it (the scale cancels in the cosine).
3. Cosine similarity between responses, then average-linkage agglomeration (scikit-learn's
   ``AgglomerativeClustering`` on the distances ``1 - similarity``): the two clusters with the
   highest mean pairwise similarity merge while that mean is at least ``threshold``.
4. Labels ``"s0"``, ``"s1"``, ... in order of first appearance.

The default ``threshold=0.15`` was chosen on the hand-written solutions in
``tests/creativity/test_lexical_judge.py`` (two problems, five methods, 2-3 phrasings each):
there, two responses of one method have similarities of 0.17-0.46 (0.29 and 0.40 on average per
problem) and responses of different methods at most 0.094, so 0.15 sits in the gap, nearer the
low side because average linkage compares cluster means. It is a judgement call on a few
examples, not a fitted value; raise it to split more, lower it to merge more.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
from sklearn.cluster import AgglomerativeClustering
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.metrics.pairwise import cosine_similarity
from sklearn.preprocessing import normalize

from opentinker.creativity.base import DedupedGroup, Group, JudgeMetrics

NUMBER_TOKEN = "<num>"
_TOKEN = re.compile(r"\d+(?:[.,]\d+)*|[a-z]+(?:'[a-z]+)?|[+\-*/=^%<>×÷√]")
_NUMBER = re.compile(r"\d")
# English function words, dropped. Words that name directions or operations in a method
# ("count up", "round down", "carry over", "work backwards", "each") are deliberately kept.
STOP_WORDS = frozenset(
    """
    a an the and or but so then than that this these those it its is are was were be been being
    am do does did of in on at to for from by with as into onto i we you he she they me us our
    my your his her their them there here what which who whom whose when where why how any
    both few most other some such no nor not only own too very can will just should now also
    let lets let's get gets got have has had having would could may might must shall if else
    out again further once about while because until yes well okay ok
    """.split()
)


def tokenize(text: str) -> list[str]:
    """Lowercase content tokens of ``text``, numbers replaced by :data:`NUMBER_TOKEN`."""
    tokens = []
    for token in _TOKEN.findall(text.lower()):
        if _NUMBER.match(token):
            tokens.append(NUMBER_TOKEN)
        elif token not in STOP_WORDS:
            tokens.append(token)
    return tokens


MATH_PREFIX = "math:"


def features(tokens: Sequence[str]) -> Counter:
    """Unigram and bigram counts: of the words, and separately (keys prefixed ``math:``) of the
    number placeholders and symbols, so prose and arithmetic never form one bigram."""
    words = [token for token in tokens if token[0].isalpha()]
    maths = [MATH_PREFIX + token for token in tokens if not token[0].isalpha()]
    grams: Counter = Counter()
    for sequence in (words, maths):
        grams.update(sequence)
        grams.update(f"{first} {second}" for first, second in zip(sequence, sequence[1:]))
    return grams


def similarity_matrix(texts: Sequence[str], math_weight: float = 0.2) -> np.ndarray:
    """Cosine similarities [n, n] of the TF-IDF vectors of ``texts``, where arithmetic grams
    weigh ``math_weight`` times as much as word grams (1 on the diagonal; two texts without any
    token count as similar, 1.0, and unlike everything else, 0.0)."""
    n = len(texts)
    bags = [features(tokenize(text)) for text in texts]
    empty = np.array([not bag for bag in bags], dtype=bool)
    similarity = np.zeros((n, n))
    if not empty.all():
        vectorizer = TfidfVectorizer(analyzer=lambda bag: list(bag.elements()), sublinear_tf=True, norm=None)
        matrix = vectorizer.fit_transform(bags)
        weights = [math_weight if gram.startswith(MATH_PREFIX) else 1.0 for gram in vectorizer.get_feature_names_out()]
        similarity = cosine_similarity(normalize(matrix.multiply(np.array(weights)[None, :]).tocsr()))
    similarity[np.ix_(empty, empty)] = 1.0
    np.fill_diagonal(similarity, 1.0)
    return similarity


def average_linkage(similarity: np.ndarray, threshold: float) -> list[int]:
    """Cluster index per item (numbered in order of first appearance): merge the most similar
    pair of clusters (mean pairwise similarity) while it is ``>= threshold``."""
    n = similarity.shape[0]
    if n < 2:
        return [0] * n
    clustering = AgglomerativeClustering(
        n_clusters=None,
        metric="precomputed",
        linkage="average",
        # scikit-learn merges below the threshold; a hair above 1 - threshold keeps ">=" merging
        distance_threshold=1.0 - threshold + 1e-9,
    ).fit(np.clip(1.0 - similarity, 0.0, None))
    first_seen: dict[int, int] = {}
    return [first_seen.setdefault(int(label), len(first_seen)) for label in clustering.labels_]


class LexicalStrategyJudge:
    """Strategy labels from lexical similarity (see the module docstring); never fails.

    Args:
        threshold: minimum mean cosine similarity for two clusters to merge (0..1).
        math_weight: weight of arithmetic grams (numbers, symbols) relative to word grams.

    Metrics: ``judge/groups``, ``judge/skipped_groups`` (one distinct response) and
    ``judge/latency_s_mean`` (seconds per group).
    """

    metric_keys = ("groups", "skipped_groups")

    def __init__(self, threshold: float = 0.15, math_weight: float = 0.2):
        if not 0.0 <= float(threshold) <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if float(math_weight) < 0.0:
            raise ValueError(f"math_weight must be >= 0, got {math_weight}")
        self.threshold = float(threshold)
        self.math_weight = float(math_weight)
        self._metrics = JudgeMetrics(self.metric_keys)

    def __repr__(self) -> str:
        return f"LexicalStrategyJudge(threshold={self.threshold}, math_weight={self.math_weight})"

    def label_responses(self, responses: Sequence[str]) -> list[str]:
        """Labels of one group's responses."""
        group = DedupedGroup.of("", responses)
        trivial = group.trivial_labels
        if trivial is not None:
            return trivial
        assignment = average_linkage(similarity_matrix(group.unique, self.math_weight), self.threshold)
        return group.expand([str(cluster) for cluster in assignment])

    def label_groups(self, groups: Sequence[Group]) -> list[list[str] | None]:
        results: list[list[str] | None] = []
        for _question, responses in groups:
            started = time.perf_counter()
            if DedupedGroup.of("", responses).trivial_labels is not None:
                self._metrics.add("skipped_groups")
            results.append(self.label_responses(responses))
            self._metrics.add("groups")
            self._metrics.add_latency(time.perf_counter() - started)
        return results

    def pop_metrics(self) -> dict[str, float]:
        return self._metrics.pop()
