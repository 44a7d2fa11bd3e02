"""Generated GSM8K-style word problems at five difficulty levels, for curricula and held-out evaluation.

Rows follow GSM8K's schema exactly, so `sources.check_rows`, `parsing.gold_number` and the prime
stage take them unchanged::

    {"question": "Ravi fills 9 baskets with 8 apples each. He sells all of the apples for $15 each. "
                 "How much money does he make?",
     "answer": "He picks 9*8=<<9*8=72>>72 apples.\\nHe makes $72*15=$<<72*15=1080>>1080.\\n#### 1080"}

One solution line per arithmetic step, each with a calculator annotation `<<expr=value>>`, and a
last line `#### N`. Every value is a positive integer, computed here exactly (no negative or
fractional intermediate results; divisions are exact).

Levels (`LEVELS`): 1 one step, 2 two steps (both only adding and taking away), 3 three or four steps
with products and shares (all given numbers <= 20),
4 two or three steps with numbers in the hundreds or thousands, 5 three or four small steps plus
a distractor (a quantity in the question that the solution does not use). A spec such as "1-3"
or "2,4" draws each row's level uniformly from those levels.

Train and test are disjoint by construction: a problem's split is a stable hash (blake2b) of its
arithmetic, the chain of `expr=value` annotations (`split_of`). The generator draws candidates
and keeps only those of the requested split, so no test problem -- not even its arithmetic told
as another story -- can appear in train, whatever the seeds and sizes. Questions never repeat
within a split. The same (split, size, level, seed, task, stories) always gives the same rows, and
a smaller size gives a prefix of a larger one.

Held-out stories: the train split never tells a problem in the story templates named in
`HELDOUT_STORIES` (a fixed list of names, 3 of the 13 stories, 2 of them able to tell level 4's
large numbers). The test split tells its problems in every story (`stories="all"`, the default,
drawn exactly as before the list existed), or with `stories="heldout"` only in the held-out ones:
problems whose arithmetic AND wording the training split never showed. `story_of(question)` names
the story a generated question is told in.

Rows carry no level column (check_rows keeps only question/answer): `level_of(question, answer)`
recovers it from the row itself, so it survives check_rows, a jsonl round trip, and TRL's dataset
columns (`question` and `solution` reach reward functions as keyword arguments).

Standard library only.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from dataclasses import dataclass
from typing import Any

from lowmem_grpo.errors import DataError
from lowmem_grpo.rewards.parsing import find_numbers

__all__ = ["HELDOUT_STORIES", "LEVELS", "SPLITS", "STEPS", "STORY_SETS", "TASKS", "generate_rows", "level_of",
           "parse_levels", "split_of", "story_of"]

LEVELS: dict[int, str] = {
    1: "one step, adding or taking away; every number in the question is at most 20",
    2: "two steps, adding or taking away; every number in the question is at most 20",
    3: "three or four steps with products and exact shares too; every number in the question is at most 20",
    4: "two or three steps with larger numbers: the question holds numbers in the hundreds or "
       "thousands (results stay integers)",
    5: "three or four steps with numbers at most 20, plus a distractor: a quantity in the question "
       "that the solution does not use",
}
"""The difficulty levels, each described in words."""

STEPS: dict[int, tuple[int, int]] = {1: (1, 1), 2: (2, 2), 3: (3, 4), 4: (2, 3), 5: (3, 4)}
"""Per level, the (fewest, most) calculator steps of its solutions."""

SIMPLE_LEVELS: frozenset[int] = frozenset({1, 2})
"""Levels whose problems only add and take away: a 135M model multiplies two-digit numbers wrongly almost always
(13*19=235), so products and shares start at level 3, where a model has learned the easier steps."""

SPLITS: tuple[str, ...] = ("train", "test")
"""The splits; `split_of` assigns every problem to exactly one of them."""

TASKS: tuple[str, ...] = ("arithmetic",)
"""The task families `generate_rows` knows."""

HELDOUT_STORIES: tuple[str, ...] = ("library", "tank", "lemonade")
"""Stories (`_Story.key`) the train split never uses: about a fifth of them, two able to tell large numbers
(library, tank) and one not (lemonade), so every level can be told in them and in the rest."""

STORY_SETS: tuple[str, ...] = ("all", "heldout")
"""What `generate_rows(stories=...)` accepts: every story the split may use, or only HELDOUT_STORIES (test only)."""

_TEST_PERCENT = 20  # share of the problem space (by arithmetic) that belongs to the test split
_SMALL_MAX = 20
_BIG_MIN = 100
_BIG_MAX = 2000
_MAX_MISSES = 5000  # consecutive rejected candidates before the space counts as exhausted

_ANNOTATION_RE = re.compile(r"<<([^<>=]+)=([^<>]+)>>")


class _Retry(Exception):
    """The drawn numbers do not work out (a division that is not exact, nothing left to subtract)."""


# --------------------------------------------------------------------------------------------
# vocabulary and story templates
# --------------------------------------------------------------------------------------------

# (name, he, him, his, himself)
_PEOPLE: tuple[tuple[str, str, str, str, str], ...] = tuple(
    (name, "she", "her", "her", "herself") if female else (name, "he", "him", "his", "himself")
    for name, female in [
        ("Maya", True), ("Liam", False), ("Priya", True), ("Carlos", False), ("Hannah", True),
        ("Kenji", False), ("Amara", True), ("Oliver", False), ("Sofia", True), ("Mateo", False),
        ("Chloe", True), ("Darius", False), ("Lena", True), ("Ethan", False), ("Fatima", True),
        ("Noah", False), ("Grace", True), ("Ravi", False), ("Isabel", True), ("Tobias", False),
        ("Zoe", True), ("Marcus", False), ("Nadia", True), ("Felix", False), ("Ruby", True),
        ("Omar", False), ("Elena", True), ("Samuel", False), ("Ingrid", True), ("Jamal", False),
    ]
)
_RELATIVES = ("cousin", "neighbor", "best friend", "grandmother", "uncle", "aunt", "classmate")


@dataclass(frozen=True)
class _Story:
    """One scenario: a running quantity and the sentences that change it.

    Question sentences use {Name} {he} {He} {him} {his} {His} {himself} {rel}, the option slots of
    `slots`, and the numbers {a} (a start), {b} (an amount), {g} {k} (groups of k), {p} (a rate)
    and {d} (a distractor). Solution sentences use {calc} (the annotated computation) and {ures}
    (the unit, singular or plural to agree with the result).
    """

    key: str  # the story's name (HELDOUT_STORIES, story_of); no unit slot means the running quantity is dollars
    big_ok: bool  # reads naturally with hundreds or thousands
    slots: dict[str, tuple[Any, ...]]  # "unit" -> ((singular, plural), ...), other slots -> options
    start: tuple[str, ...]
    groups: tuple[tuple[str, str], ...]  # start as g groups of k: (question, solution)
    add: tuple[tuple[str, str], ...]
    add_groups: tuple[tuple[str, str, str], ...]  # (question, product line, new-total line)
    sub: tuple[tuple[str, str], ...]
    div: tuple[tuple[str, str, str], ...]  # final exact division: (sentence, ask, solution)
    mul: tuple[tuple[str, str, str, Any], ...]  # final product: (sentence, ask, solution, unit | None)
    ask: tuple[str, ...]
    distract: tuple[str, ...]


_PERSON_DISTRACT = (
    "{Name} is {d} years old.",
    "{His} {rel} is {d} years old.",
    "{Name} lives {d} miles from school.",
)

_STORIES: tuple[_Story, ...] = (
    _Story(
        key="orchard", big_ok=True,
        slots={"unit": (("apple", "apples"), ("orange", "oranges"), ("pear", "pears"), ("plum", "plums"))},
        start=("{Name} picks {a} {u} at the orchard.",),
        groups=(("{Name} fills {g} baskets with {k} {u} each.", "{He} picks {calc} {ures}."),),
        add=(("{He} picks {b} more {u}.", "After picking more, {he} has {calc} {ures}."),
             ("{His} {rel} gives {him} {b} {u}.", "With the gift, {he} has {calc} {ures}.")),
        add_groups=(("{He} also buys {g} bags with {k} {u} in each bag.", "The bags hold {calc} {ures}.",
                     "Now {he} has {calc} {ures}."),),
        sub=(("{He} eats {b} of the {u}.", "After eating some, {he} has {calc} {ures} left."),
             ("{He} gives {b} {u} to {his} {rel}.", "After the gift, {he} has {calc} {ures} left.")),
        div=(("{He} shares the {u} equally among {k} friends.", "How many {u} does each friend get?",
              "Each friend gets {calc} {ures}."),),
        mul=(("{He} sells all of the {u} for ${p} each.", "How much money does {he} make?",
              "{He} makes {calc}.", None),),
        ask=("How many {u} does {Name} have now?",),
        distract=("The orchard has {d} rows of trees.",) + _PERSON_DISTRACT,
    ),
    _Story(
        key="baking", big_ok=True,
        slots={"unit": (("cookie", "cookies"), ("muffin", "muffins"), ("cupcake", "cupcakes"))},
        start=("{Name} bakes {a} {u} for a party.",),
        groups=(("{Name} bakes {g} trays of {u} with {k} {u} on each tray.", "{He} bakes {calc} {ures}."),),
        add=(("{He} bakes {b} more {u}.", "Then {he} has {calc} {ures}."),
             ("{His} {rel} brings {b} more {u}.", "With those, {he} has {calc} {ures}.")),
        add_groups=(("{He} then bakes {g} more trays with {k} {u} on each tray.",
                     "The new trays hold {calc} {ures}.", "Altogether {he} has {calc} {ures}."),),
        sub=(("{His} family eats {b} of the {u}.", "After that, {calc} {ures} are left."),
             ("{He} gives {b} {u} to {his} {rel}.", "{He} keeps {calc} {ures}.")),
        div=(("{He} packs the {u} equally into {k} boxes.", "How many {u} go in each box?",
              "Each box holds {calc} {ures}."),),
        mul=(("{He} sells every one of them at the bake sale for ${p}.", "How much money does {he} raise?",
              "{He} raises {calc}.", None),),
        ask=("How many {u} does {Name} have now?",),
        distract=("The oven is set to {d} degrees higher than usual.", "Each tray is {d} inches wide.")
        + _PERSON_DISTRACT,
    ),
    _Story(
        key="savings", big_ok=True, slots={},
        start=("{Name} has ${a} in {his} piggy bank.",),
        groups=(("{Name} saves ${k} every week for {g} weeks.", "{He} saves {calc}."),),
        add=(("{His} {rel} gives {him} ${b} for {his} birthday.", "Then {he} has {calc}."),
             ("{He} earns ${b} for washing cars.", "With that, {he} has {calc}.")),
        add_groups=(("{He} babysits for {g} hours and earns ${k} an hour.", "Babysitting earns {him} {calc}.",
                     "Now {he} has {calc}."),),
        sub=(("{He} spends ${b} on a book.", "After buying the book, {he} has {calc}."),
             ("{He} pays ${b} for a concert ticket.", "After the ticket, {he} has {calc}.")),
        div=(("{He} gives all of the money equally to {k} charities.", "How much money does each charity get?",
              "Each charity gets {calc}."),),
        mul=(),
        ask=("How much money does {Name} have now?",),
        distract=("{His} piggy bank is shaped like a pig and is {d} inches tall.",) + _PERSON_DISTRACT,
    ),
    _Story(
        key="travel", big_ok=True,
        slots={"unit": (("mile", "miles"), ("kilometer", "kilometers")),
               "place": ("a lake", "the coast", "a national park", "a mountain town")},
        start=("{Name} is driving to {place} that is {a} {u} away.",),
        groups=(("{Name} plans a trip to {place} in {g} stages of {k} {u} each.", "The trip is {calc} {ures} long."),),
        add=(("A closed road makes {him} take a detour that adds {b} {u}.",
              "With the detour, {he} has {calc} {ures} to go."),
             ("{He} misses an exit, which adds {b} {u} to the trip.", "Then {he} has {calc} {ures} to go.")),
        add_groups=(("{He} has to take {g} detours of {k} {u} each.", "The detours add {calc} {ures}.",
                     "So {he} has {calc} {ures} to go."),),
        sub=(("{He} drives {b} {u} before lunch.", "{He} has {calc} {ures} left to drive."),
             ("{He} drives {b} {u} before stopping for gas.", "{He} still has {calc} {ures} to drive.")),
        div=(("{He} wants to drive the rest of the way in {k} equal parts.", "How many {u} long is each part?",
              "Each part is {calc} {ures} long."),),
        mul=(),
        ask=("How many {u} does {Name} still have to drive?",),
        distract=("{His} car has {d} gallons of gas in the tank.", "The speed limit changes {d} times on the way.")
        + _PERSON_DISTRACT,
    ),
    _Story(
        key="school", big_ok=True,
        slots={"unit": (("student", "students"),), "kind": ("dance", "music", "art", "swimming")},
        start=("{Name}'s {kind} school has {a} students.",),
        groups=(("{Name}'s {kind} school has {g} classes with {k} students in each class.",
                 "The school has {calc} {ures}."),),
        add=(("Then {b} new students join the school.", "Then the school has {calc} {ures}."),
             ("Later, {b} more students sign up.", "Then there are {calc} {ures}.")),
        add_groups=(("Then {g} new classes with {k} students each join the school.",
                     "The new classes have {calc} {ures}.", "Then the school has {calc} {ures}."),),
        sub=(("Then {b} students move to another town.", "That leaves {calc} {ures}."),
             ("On Friday, {b} students are away on a trip.", "On Friday, {calc} {ures} are at school.")),
        div=(("{Name}, a teacher, splits the students into {k} equal groups for the spring show.",
              "How many students are in each group?", "Each group has {calc} {ures}."),),
        mul=(("Each student gets {p} stickers at the end of the year.", "How many stickers do the students get?",
              "They get {calc} {ures}.", ("sticker", "stickers")),),
        ask=("How many students are at the school now?",),
        distract=("The school has {d} teachers.", "The school was built {d} years ago."),
    ),
    _Story(
        key="garden", big_ok=False,
        slots={"unit": (("tomato plant", "tomato plants"), ("pepper plant", "pepper plants"))},
        start=("{Name} plants {a} {u} in {his} garden.",),
        groups=(("{Name} plants {g} rows of {u} with {k} {u} in each row.", "{He} plants {calc} {ures}."),),
        add=(("{He} plants {b} more {u}.", "Then {he} has {calc} {ures}."),
             ("{His} {rel} gives {him} {b} more {u}.", "With the gift, {he} has {calc} {ures}.")),
        add_groups=(("{He} buys {g} more trays of {k} {u} each and plants them all.",
                     "The trays hold {calc} {ures}.", "Then {he} has {calc} {ures}."),),
        sub=(("Rabbits eat {b} of the {u}.", "After the rabbits, {calc} {ures} are left."),
             ("{He} gives {b} {u} to {his} {rel}.", "{He} keeps {calc} {ures}.")),
        div=(("{He} moves all of the {u} into {k} beds with the same number in each.",
              "How many {u} are in each bed?", "Each bed has {calc} {ures}."),),
        mul=(("Each plant gives {p} vegetables at harvest time.", "How many vegetables does {he} harvest?",
              "{He} harvests {calc} {ures}.", ("vegetable", "vegetables")),),
        ask=("How many {u} does {Name} have now?",),
        distract=("The garden is {d} meters long.", "{He} waters the garden {d} times a week.")
        + _PERSON_DISTRACT,
    ),
    _Story(
        key="library", big_ok=True, slots={"unit": (("book", "books"),)},
        start=("A town library has {a} books.",),
        groups=(("A town library has {g} shelves with {k} books on each shelf.", "The library has {calc} {ures}."),),
        add=(("The library gets {b} new books as a gift.", "Then it has {calc} {ures}."),
             ("Readers return {b} books they borrowed last month.", "With those, it has {calc} {ures}.")),
        add_groups=(("The library buys {g} boxes of new books with {k} books in each box.",
                     "The boxes hold {calc} {ures}.", "Then the library has {calc} {ures}."),),
        sub=(("Readers borrow {b} books.", "That leaves {calc} {ures} in the library."),
             ("The library gives away {b} old books.", "Then the library has {calc} {ures}.")),
        div=(("The librarian puts all of the books equally on {k} new shelves.", "How many books go on each shelf?",
              "Each shelf holds {calc} {ures}."),),
        mul=(),
        ask=("How many books does the library have now?",),
        distract=("The library has been open for {d} years.", "The library has {d} computers."),
    ),
    _Story(
        key="eggs", big_ok=True, slots={"unit": (("egg", "eggs"),)},
        start=("{Name}'s chickens lay {a} eggs this week.",),
        groups=(("{Name} has {g} chickens that each lay {k} eggs this month.", "They lay {calc} {ures}."),),
        add=(("{He} buys {b} more eggs from {his} {rel}.", "Then {he} has {calc} {ures}."),
             ("The next morning, the chickens lay {b} more eggs.", "Now {he} has {calc} {ures}.")),
        add_groups=(("{He} also collects {g} cartons of {k} eggs from {his} {rel}'s farm.",
                     "The cartons hold {calc} {ures}.", "Then {he} has {calc} {ures}."),),
        sub=(("{He} uses {b} eggs to bake cakes.", "After baking, {he} has {calc} {ures}."),
             ("{He} drops {b} eggs, and they break.", "{He} has {calc} {ures} left.")),
        div=(("{He} packs the eggs equally into {k} baskets.", "How many eggs go in each basket?",
              "Each basket holds {calc} {ures}."),),
        mul=(),
        ask=("How many eggs does {Name} have now?",),
        distract=("The chicken coop is {d} feet long.", "{His} farm also has {d} goats.") + _PERSON_DISTRACT,
    ),
    _Story(
        key="stickers", big_ok=False,
        slots={"unit": (("sticker", "stickers"), ("trading card", "trading cards"), ("marble", "marbles"))},
        start=("{Name} has {a} {u}.",),
        groups=(("{Name} buys {g} packs of {u} with {k} {u} in each pack.", "{He} buys {calc} {ures}."),),
        add=(("{His} {rel} gives {him} {b} {u}.", "Then {he} has {calc} {ures}."),
             ("{He} wins {b} {u} in a game.", "After the game, {he} has {calc} {ures}.")),
        add_groups=(("{He} wins {g} more packs with {k} {u} in each.", "The packs hold {calc} {ures}.",
                     "Then {he} has {calc} {ures}."),),
        sub=(("{He} trades away {b} {u}.", "After the trade, {he} has {calc} {ures}."),
             ("{He} loses {b} {u} on the way home.", "{He} has {calc} {ures} left.")),
        div=(("{He} shares the {u} equally among {k} friends.", "How many {u} does each friend get?",
              "Each friend gets {calc} {ures}."),),
        mul=(),
        ask=("How many {u} does {Name} have now?",),
        distract=("{His} {rel} has {d} {u}.",) + _PERSON_DISTRACT,
    ),
    _Story(
        key="bus", big_ok=False, slots={"unit": (("passenger", "passengers"),)},
        start=("A bus leaves the station with {a} passengers.",),
        groups=(("A bus has {g} rows of seats with {k} seats in each row, and every seat is taken.",
                 "There are {calc} {ures} on the bus."),),
        add=(("At the first stop, {b} more passengers get on.", "Then there are {calc} {ures}."),
             ("At another stop, {b} passengers get on.", "Then there are {calc} {ures}.")),
        add_groups=(("At the school stop, {g} groups of {k} students get on.", "The groups add {calc} {ures}.",
                     "Then there are {calc} {ures}."),),
        sub=(("At the next stop, {b} passengers get off.", "That leaves {calc} {ures}."),
             ("At a busy corner, {b} passengers get off.", "Then {calc} {ures} are left on the bus.")),
        div=(("At the end of the line, the passengers split into {k} equal tour groups.",
              "How many passengers are in each tour group?", "Each tour group has {calc} {ures}."),),
        mul=(("At the end of the line, each passenger pays ${p} for a museum ticket.",
              "How much money do the tickets cost in all?", "The tickets cost {calc}.", None),),
        ask=("How many passengers are on the bus now?",),
        distract=("The bus driver has worked for {d} years.", "The bus is {d} years old."),
    ),
    _Story(
        key="lemonade", big_ok=False, slots={"unit": (("cup of lemonade", "cups of lemonade"),)},
        start=("{Name} makes {a} cups of lemonade for {his} stand.",),
        groups=(("{Name} makes {g} pitchers of lemonade, and each pitcher fills {k} cups.",
                 "{He} makes {calc} {ures}."),),
        add=(("{He} makes {b} more cups of lemonade.", "Then {he} has {calc} {ures}."),
             ("{His} {rel} brings {b} more cups of lemonade.", "Now {he} has {calc} {ures}.")),
        add_groups=(("{His} {rel} brings {g} more pitchers that fill {k} cups each.",
                     "The pitchers fill {calc} {ures}.", "Then {he} has {calc} {ures}."),),
        sub=(("{He} drinks {b} cups {himself}.", "After that, {he} has {calc} {ures}."),
             ("{He} spills {b} cups of lemonade.", "{He} has {calc} {ures} left.")),
        div=(("{He} pours the lemonade equally into {k} coolers.", "How many cups of lemonade go in each cooler?",
              "Each cooler gets {calc} {ures}."),),
        mul=(("{He} sells every cup for ${p}.", "How much money does {he} make?", "{He} makes {calc}.", None),),
        ask=("How many cups of lemonade does {Name} have now?",),
        distract=("The stand is {d} feet from the corner.",) + _PERSON_DISTRACT,
    ),
    _Story(
        key="factory", big_ok=True, slots={"unit": (("toy", "toys"), ("bottle", "bottles"), ("bolt", "bolts"))},
        start=("A factory makes {a} {u} on Monday.",),
        groups=(("A factory has {g} machines that each make {k} {u} on Monday.", "The machines make {calc} {ures}."),),
        add=(("On Tuesday, the factory makes {b} more {u}.", "Then it has {calc} {ures}."),
             ("A second shift makes {b} more {u}.", "Then the factory has {calc} {ures}.")),
        add_groups=(("On Tuesday, {g} workers each make {k} more {u}.", "The workers make {calc} {ures}.",
                     "Then the factory has {calc} {ures}."),),
        sub=(("Then {b} {u} fail the safety check and are thrown away.", "That leaves {calc} {ures}."),
             ("The factory ships {b} {u} to a store.", "Then it has {calc} {ures}.")),
        div=(("The {u} are packed equally into {k} crates.", "How many {u} go in each crate?",
              "Each crate holds {calc} {ures}."),),
        mul=(("The {u} are sold for ${p} each.", "How much money do they sell for?", "They sell for {calc}.", None),),
        ask=("How many {u} does the factory have now?",),
        distract=("The factory has {d} managers.", "The factory opened {d} years ago."),
    ),
    _Story(
        key="tank", big_ok=True, slots={"unit": (("liter", "liters"), ("gallon", "gallons"))},
        start=("A tank holds {a} {u} of water.",),
        groups=(("A pump fills an empty tank at {k} {u} a minute for {g} minutes.",
                 "The tank holds {calc} {ures} of water."),),
        add=(("It rains, and {b} {u} of water flow into the tank.", "Then the tank holds {calc} {ures}."),
             ("{Name} adds {b} {u} with a hose.", "Now the tank holds {calc} {ures}.")),
        add_groups=(("{Name} pours in {g} buckets of {k} {u} each.", "The buckets hold {calc} {ures}.",
                     "Then the tank holds {calc} {ures}."),),
        sub=(("{Name} uses {b} {u} to water the garden.", "Then the tank holds {calc} {ures}."),
             ("A leak lets {b} {u} drain away.", "That leaves {calc} {ures} in the tank.")),
        div=(("{Name} pours all of the water equally into {k} barrels.", "How many {u} are in each barrel?",
              "Each barrel holds {calc} {ures}."),),
        mul=(),
        ask=("How many {u} of water are in the tank now?",),
        distract=("The tank is {d} years old.", "The garden has {d} flower beds.") + _PERSON_DISTRACT,
    ),
)

_BIG_STORIES = tuple(s for s in _STORIES if s.big_ok)


def _pools(split: str, stories: str) -> tuple[tuple[_Story, ...], tuple[_Story, ...]]:
    """The stories a split draws from: (for small numbers, for level 4's big numbers)."""
    if stories == "heldout":
        keep = [s for s in _STORIES if s.key in HELDOUT_STORIES]
    elif split == "train":
        keep = [s for s in _STORIES if s.key not in HELDOUT_STORIES]
    else:
        return _STORIES, _BIG_STORIES
    return tuple(keep), tuple(s for s in keep if s.big_ok)


_SLOT_PATTERNS = {
    "Name": "(?:" + "|".join(p[0] for p in _PEOPLE) + ")",
    "rel": "(?:" + "|".join(_RELATIVES) + ")",
    **{k: "[A-Za-z]+" for k in ("he", "He", "him", "his", "His", "himself")},
    **{k: "[\\d,]+" for k in "abgkpd"},
}


def _opening_pattern(story: _Story) -> re.Pattern[str]:
    """The question's first sentence as this story opens it (a start or groups template)."""
    slots = dict(_SLOT_PATTERNS)
    for slot, options in story.slots.items():
        words = [o[1] for o in options] if slot == "unit" else list(options)
        slots["u" if slot == "unit" else slot] = "(?:" + "|".join(map(re.escape, words)) + ")"
    alternatives = []
    for template in (*story.start, *(q for q, _ in story.groups)):
        parts = []
        for literal, field_name, _, _ in string.Formatter().parse(template):
            parts.append(re.escape(literal))
            if field_name is not None:
                parts.append(slots[field_name])
        alternatives.append("".join(parts))
    return re.compile("(?:" + "|".join(alternatives) + ")(?= |$)")


_OPENINGS = tuple((story.key, _opening_pattern(story)) for story in _STORIES)


# --------------------------------------------------------------------------------------------
# building one problem
# --------------------------------------------------------------------------------------------

def _plural(value: int, unit: tuple[str, str] | None) -> str:
    if unit is None:
        return ""
    return unit[0] if value == 1 else unit[1]


def _show(n: int) -> str:
    """A number as the question writes it: thousands separated by commas."""
    return f"{n:,}"


class _Builder:
    """Collects question sentences, solution lines and the arithmetic of one problem."""

    def __init__(self, rng: random.Random, story: _Story, big: bool) -> None:
        self.rng, self.story, self.big = rng, story, big
        person = rng.choice(_PEOPLE)
        self.words: dict[str, str] = {
            "Name": person[0], "he": person[1], "He": person[1].capitalize(), "him": person[2],
            "his": person[3], "His": person[3].capitalize(), "himself": person[4], "rel": rng.choice(_RELATIVES),
        }
        self.unit: tuple[str, str] | None = None
        for slot, options in story.slots.items():
            choice = rng.choice(options)
            if slot == "unit":
                self.unit = choice
                self.words["u"] = choice[1]
            else:
                self.words[slot] = choice
        self.sentences: list[str] = []
        self.lines: list[str] = []
        self.steps: list[tuple[str, int]] = []
        self.value = 0
        self._used: set[Any] = set()

    def pick(self, options: tuple[Any, ...]) -> Any:
        """A template of `options`, one this problem has not used yet when there is one."""
        fresh = [o for o in options if o not in self._used] or list(options)
        choice = self.rng.choice(fresh)
        self._used.add(choice)
        return choice

    def small(self, low: int = 2, high: int = _SMALL_MAX) -> int:
        return self.rng.randint(low, high)

    def amount(self, high: int | None = None) -> int:
        """A given number: at most 20, or in the hundreds/thousands for a big problem."""
        if not self.big:
            top = _SMALL_MAX if high is None else min(_SMALL_MAX, high)
            if top < 2:
                raise _Retry("no small amount fits")
            return self.rng.randint(2, top)
        top = _BIG_MAX if high is None else min(_BIG_MAX, high)
        if top < _BIG_MIN:
            raise _Retry("no big amount fits")
        n = self.rng.randint(_BIG_MIN, top)
        step = self.rng.choice((1, 5, 10, 25, 50))
        n = max(_BIG_MIN, n - n % step)
        return n

    def say(self, template: str, **numbers: int) -> None:
        self.sentences.append(template.format(**self.words, **{k: _show(v) for k, v in numbers.items()}))

    def calc(self, template: str, expr: str, value: int, unit: tuple[str, str] | None | str = "running") -> int:
        """Add one solution line computing `expr` (= `value`), in the running unit or `unit` (None: dollars)."""
        if value <= 0:
            raise _Retry("non-positive result")
        unit = self.unit if unit == "running" else unit
        if unit is None:  # dollars, written the way GSM8K does: $4*5=$<<4*5=20>>20
            text = f"${expr}=$<<{expr}={value}>>{value}"
        else:
            text = f"{expr}=<<{expr}={value}>>{value}"
        self.lines.append(template.format(**self.words, calc=text, ures=_plural(value, unit)))
        self.steps.append((expr, value))
        return value


def _fill(rng: random.Random, steps: int, story: _Story, simple: bool = False) -> tuple[int, list[int], str]:
    """Pick the problem's shape: start cost (0 or 1), middle event costs (1 or 2), and the ending. A `simple`
    problem only adds and takes away: a plain start, one-step events, and the running amount asked for."""
    if simple:
        return 0, [1] * steps, "ask"
    endings = ["ask"] + (["div"] if story.div else []) + (["mul"] if story.mul else [])
    for _ in range(50):
        start = rng.choice((0, 1))
        ending = rng.choice(endings)
        rest = steps - start - (ending != "ask")
        if rest < 0 or (start == 0 and rest == 0 and ending == "ask"):
            continue
        middle: list[int] = []
        while rest > 0:
            cost = 2 if rest >= 2 and story.add_groups and rng.random() < 0.3 else 1
            middle.append(cost)
            rest -= cost
        if start == 0 and not middle and ending == "ask":
            continue
        return start, middle, ending
    raise _Retry("no shape")  # pragma: no cover - some shape always fits within 50 draws


def _end(rng: random.Random, b: _Builder, story: _Story, ending: str, big: bool) -> str:
    """The ending: ask for the running amount, share it out exactly, or price it; returns the question asked."""
    if ending == "div":
        sentence, ask, line = rng.choice(story.div)
        divisors = [k for k in range(2, _SMALL_MAX + 1) if b.value % k == 0 and b.value // k >= 2]
        if not divisors:
            raise _Retry("no exact division")
        k = rng.choice(divisors)
        b.say(sentence, k=k)
        b.value = b.calc(line, f"{b.value}/{k}", b.value // k)
    elif ending == "mul":
        sentence, ask, line, unit = rng.choice(story.mul)
        p = b.small(2, 12 if big else _SMALL_MAX)
        b.say(sentence, p=p)
        b.value = b.calc(line, f"{b.value}*{p}", b.value * p, unit=unit)
    else:
        ask = rng.choice(story.ask)
    return ask


def _distract(rng: random.Random, b: _Builder, story: _Story) -> None:
    """Insert a quantity the solution never uses anywhere after the first sentence (level 5)."""
    used = {n for expr, value in b.steps for n in (*map(int, re.findall(r"\d+", expr)), value)}
    choices = [d for d in range(2, _SMALL_MAX + 1) if d not in used]
    if not choices:
        raise _Retry("no distractor value")
    d = rng.choice(choices)
    template = b.pick(story.distract)
    text = template.format(**b.words, d=_show(d))
    b.sentences.insert(rng.randint(1, len(b.sentences)), text)


def _build(rng: random.Random, level: int, pools: tuple[tuple[_Story, ...], tuple[_Story, ...]]
           ) -> tuple[str, str, tuple[tuple[str, int], ...]]:
    """One candidate problem of `level` told in a story of `pools` (see _pools): (question, answer, arithmetic
    steps). Raises _Retry."""
    big = level == 4
    story = rng.choice(pools[1] if big else pools[0])
    low, high = STEPS[level]
    start, middle, ending = _fill(rng, rng.randint(low, high), story, simple=level in SIMPLE_LEVELS)
    b = _Builder(rng, story, big)

    # the start: a plain amount, or g groups of k
    if start == 0:
        a = b.amount()
        b.say(rng.choice(story.start), a=a)
        b.value = a
    else:
        template, line = b.pick(story.groups)
        g, k = b.small(2, 12), b.amount(high=600)
        b.say(template, g=g, k=k)
        b.value = b.calc(line, f"{g}*{k}", g * k)

    # the middle: amounts added or taken away, or groups added
    for cost in middle:
        if cost == 2:
            template, product_line, total_line = b.pick(story.add_groups)
            g, k = b.small(2, 9), b.amount(high=600)
            b.say(template, g=g, k=k)
            product = b.calc(product_line, f"{g}*{k}", g * k)
            b.value = b.calc(total_line, f"{b.value}+{product}", b.value + product)
            continue
        can_sub = story.sub and b.value > (_BIG_MIN if big else 2)
        if can_sub and (not story.add or rng.random() < 0.5):
            template, line = b.pick(story.sub)
            amount = b.amount(high=b.value - 1)
            b.say(template, b=amount)
            b.value = b.calc(line, f"{b.value}-{amount}", b.value - amount)
        elif story.add:
            template, line = b.pick(story.add)
            amount = b.amount()
            b.say(template, b=amount)
            b.value = b.calc(line, f"{b.value}+{amount}", b.value + amount)
        else:  # pragma: no cover - every story can add
            raise _Retry("no event")

    ask = _end(rng, b, story, ending, big)
    if level == 5:  # a quantity the solution never uses, placed anywhere after the first sentence
        _distract(rng, b, story)

    question = " ".join(b.sentences + [ask.format(**b.words)])
    answer = "\n".join(b.lines + [f"#### {b.value}"])
    return question, answer, tuple(b.steps)


# --------------------------------------------------------------------------------------------
# splits and levels
# --------------------------------------------------------------------------------------------

def _annotations(answer: str) -> list[tuple[str, str]]:
    return [(expr.strip(), value.strip()) for expr, value in _ANNOTATION_RE.findall(answer)]


def _bucket(key: str) -> int:
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 100


def split_of(answer: str) -> str:
    """The split a problem belongs to, from its worked solution: "train" or "test".

    The key is the problem's arithmetic (its `<<expr=value>>` annotations in order, or the whole
    solution when it has none), hashed with blake2b, so the answer is the same on every machine
    and in every process; about 20% of the problem space is test.
    """
    steps = _annotations(answer)
    key = "|".join(f"{e}={v}" for e, v in steps) if steps else " ".join(answer.split())
    return "test" if _bucket(key) < _TEST_PERCENT else "train"


def parse_levels(spec: int | str) -> tuple[int, ...]:
    """The levels a spec names: 3 or "3" -> (3,), "1-3" -> (1, 2, 3), "2,4" -> (2, 4).

    Raises DataError for anything else (levels run from 1 to 5).
    """
    fix = f"use a level from 1 to {max(LEVELS)}, a range such as '1-3', or a list such as '2,4'"
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise DataError(f"level spec {spec!r} is not a level, range or list", fix=fix)
    text = str(spec).strip()
    try:
        if re.fullmatch(r"\d+\s*-\s*\d+", text):
            first, last = (int(x) for x in text.split("-"))
            if first > last:
                raise ValueError
            levels = tuple(range(first, last + 1))
        else:
            levels = tuple(dict.fromkeys(int(x) for x in text.split(",")))
    except ValueError:
        raise DataError(f"level spec {spec!r} is not a level, range or list", fix=fix) from None
    unknown = [lv for lv in levels if lv not in LEVELS]
    if unknown or not levels:
        raise DataError(f"level spec {spec!r} names unknown level(s) {unknown}", fix=fix)
    return levels


def level_of(question: str, answer: str) -> int:
    """The level of a generated problem, recovered from its question and worked solution.

    5 when the question holds a number the solution never uses (a distractor); else 4 when the
    question holds a number of 100 or more; else 1, 2 or 3 by the number of calculator steps.
    Meant for rows of `generate_rows` (in a trainer: the `question` and `solution` columns).
    """
    steps = _annotations(answer)
    used = set()
    for expr, value in steps:
        used.update(re.findall(r"\d+", expr))
        used.add(value)
    given = [n.replace(",", "") for n in find_numbers(question)]
    if any(n not in used for n in given):
        return 5
    if any(float(n) >= _BIG_MIN for n in given):
        return 4
    return min(max(len(steps), 1), 3)


def story_of(question: str) -> str | None:
    """The name (a `_Story.key`, as in HELDOUT_STORIES) of the story a generated question is told in, from its
    first sentence; None for a question no story opens that way (e.g. a real GSM8K problem)."""
    found = [key for key, pattern in _OPENINGS if pattern.match(question)]
    return found[0] if len(found) == 1 else None


def generate_rows(split: str, size: int, level: int | str, seed: int, task: str = "arithmetic",
                  stories: str = "all") -> list[dict[str, str]]:
    """`size` GSM8K-style rows {"question", "answer"} of `split` at `level` (a level, "1-3" or "2,4").

    Deterministic: the same arguments give the same rows, and a smaller size gives a prefix of a
    larger one. A mixed spec draws each row's level uniformly. Rows of "train" and "test" never
    share a problem (see `split_of`), and questions never repeat within a call. "train" never uses
    a story of HELDOUT_STORIES; `stories="heldout"` (test only) tells every row in one of them.
    Raises DataError on a bad argument, or when the split runs out of new problems at this level.
    """
    if split not in SPLITS:
        raise DataError(f"generated data has no split {split!r}", fix=f"use one of {', '.join(SPLITS)}")
    if task not in TASKS:
        raise DataError(f"unknown generated task {task!r}", fix=f"use one of {', '.join(TASKS)}")
    if stories not in STORY_SETS:
        raise DataError(f"generated stories {stories!r} are not a story set", fix=f"use one of {', '.join(STORY_SETS)}")
    if stories == "heldout" and split != "test":
        raise DataError(f"the {split} split never tells problems in the held-out stories",
                        fix="draw held-out stories from the test split, or use stories=all")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise DataError(f"size {size!r} is not a count of rows", fix="pass a whole number >= 0")
    levels = parse_levels(level)
    pools = _pools(split, stories)
    tail = "" if stories == "all" else f"|{stories}"  # "all" keeps the test split's rows as they were
    rng = random.Random(f"lowmem_grpo.generated|{task}|{split}|{','.join(map(str, levels))}|{seed}{tail}")
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(rows) < size:
        lv = rng.choice(levels)
        for _ in range(_MAX_MISSES):
            try:
                question, answer, _steps = _build(rng, lv, pools)
            except _Retry:
                continue
            if question not in seen and split_of(answer) == split:
                break
        else:
            raise DataError(f"found no new {split} problem at level {lv} in {_MAX_MISSES} tries "
                            f"after {len(rows)} rows", fix="ask for fewer rows, or mix in more levels")
        seen.add(question)
        rows.append({"question": question, "answer": answer})
    return rows
