#!/usr/bin/env python3
"""Generate the small GSM8K-style sample embedded in ``lowmem_grpo``.

The problems are written for this project from templates (they are not copied from GSM8K), but follow GSM8K's
format exactly: every row is ``{"question": str, "answer": str}``; the answer is a worked solution with one
reasoning step per line, each computation carrying a calculator annotation such as ``3*4=<<3*4=12>>12``, and a
final line ``#### N``.

Each template is one row of TEMPLATES: its name; its draws (Python statements run in order with R = randint,
C = choice, P = a person (name, subject, object and possessive pronoun), retry_if(condition) = draw again); the
question (``{name}`` fields, ``{s!c}`` capitalized, ``{n:,}`` sometimes with thousands commas, drawn); and the
steps, ``EXPR -> LINE`` (``$>`` for money), where LINE's ``@`` becomes the annotated calculation of EXPR and
``{v1}``, ``{v2}``, ... are the values of the steps before.

The output is fully deterministic (fixed seed, standard library only)::

    python tools/make_embedded_gsm8k.py                 # writes into the package
    python tools/make_embedded_gsm8k.py --out-dir /tmp/x
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import string
from fractions import Fraction
from pathlib import Path
from typing import Any, NamedTuple, Sequence

SEED = 20240817
N_TRAIN = 240
N_TEST = 120
TRAIN_FILE = "train.jsonl"
TEST_FILE = "test.jsonl"
MAX_TRIES = 2000
DEFAULT_OUT_DIR = Path(__file__).resolve().parents[1] / "lowmem_grpo" / "resources" / "gsm8k"
_ALLOWED_CHARS = set("0123456789+-*/(). ")
_OPERATORS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__,
              ast.Div: Fraction.__truediv__}


def evaluate(expr: str) -> Fraction:
    """Exactly evaluate an arithmetic expression made of digits, + - * / ( ) ."""
    if not expr or set(expr) - _ALLOWED_CHARS:
        raise ValueError(f"bad characters in expression: {expr!r}")

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            return ev(node.operand) * (1 if isinstance(node.op, ast.UAdd) else -1)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported syntax in expression: {expr!r}")

    return ev(ast.parse(expr, mode="eval"))


class Retry(Exception):
    """Raised when the drawn numbers do not work out."""


def retry_if(condition: Any) -> None:
    if condition:
        raise Retry()


# (name, subject pronoun, object pronoun, possessive pronoun), she and he alternating
PEOPLE = [(name, *(("she", "her", "her"), ("he", "him", "his"))[i % 2]) for i, name in enumerate(
    "Maya Liam Priya Carlos Hannah Kenji Amara Oliver Sofia Mateo Chloe Darius Lena Ethan Fatima Noah Grace Ravi "
    "Isabel Tobias Zoe Marcus Nadia Felix Ruby Omar Elena Samuel Ingrid Jamal Keiko Victor Aisha Lucas Bianca "
    "Henry".split())]
RELATIVES_F = ["sister", "aunt", "cousin", "grandmother", "neighbor"]
RELATIVES_M = ["brother", "uncle", "cousin", "grandfather", "neighbor"]


def smallest_bill(total: int) -> int:
    for bill in (10, 20, 50, 100, 200, 500):
        if bill > total:
            return bill
    raise Retry("total too large")


class Template(NamedTuple):
    """One template: its name, draws, question and steps (the module docstring)."""

    name: str
    draws: str
    question: str
    steps: tuple[str, ...]


def T(name: str, draws: str, question: str, *steps: str) -> Template:
    return Template(name, draws, question, steps)


class Wording(string.Formatter):
    """``{x!c}``: capitalized; ``{n:,}``: the number, with thousands commas 7 times in 10 from 1,000 (a draw)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        return value[0].upper() + value[1:] if conversion == "c" else super().convert_field(value, conversion)

    def format_field(self, value: Any, spec: str) -> str:
        if spec == ",":
            return f"{value:,}" if value >= 1000 and self.rng.random() < 0.7 else str(value)
        return super().format_field(value, spec)


def draw(template: Template, rng: random.Random) -> tuple[str, list[str], int]:
    """The question, the solution's lines and the answer of one draw of `template` (Retry: numbers that do not work
    out)."""

    def person(exclude: Sequence[str] = ()) -> tuple[str, str, str, str]:
        while True:
            p = rng.choice(PEOPLE)
            if p[0] not in exclude:
                return p

    ns: dict[str, Any] = {"R": rng.randint, "C": rng.choice, "P": person, "r": rng, "retry_if": retry_if,
                          "smallest_bill": smallest_bill, "RELATIVES_F": RELATIVES_F, "RELATIVES_M": RELATIVES_M}
    exec(template.draws, ns)  # noqa: S102 - the templates of this file
    wording = Wording(rng)
    question, lines, value = wording.format(template.question, **ns), [], 0
    for i, step in enumerate(template.steps, 1):
        expr, sep, line = step.partition(" $> ") if " $> " in step else step.partition(" -> ")
        expr = expr.format(**ns)
        result = evaluate(expr)
        if result.denominator != 1 or result <= 0:
            raise Retry(expr)
        value = ns[f"v{i}"] = int(result)
        text = f"${expr}=$<<{expr}={value}>>{value}" if sep == " $> " else f"{expr}=<<{expr}={value}>>{value}"
        lines.append(wording.format(line, **ns).replace("@", text))
    return question, lines, value


TEMPLATES = [
    T("school_supplies", "n, s, o, p = P(); item1, item2 = C([('notebooks', 'pens'), ('folders', 'markers'), "
      "('erasers', 'pencils'), ('binders', 'highlighters')]); a, pa = R(2, 6), R(2, 7); b, pb = R(2, 8), R(2, 4); "
      "bill = smallest_bill(a * pa + b * pb)",
      "{n} buys {a} {item1} that cost ${pa} each and {b} {item2} that cost ${pb} each. If {s} pays with a ${bill} "
      "bill, how much change does {s} get back?",
      "{a}*{pa} $> The {item1} cost @.", "{b}*{pb} $> The {item2} cost @.", "{v1}+{v2} $> Altogether {s} spends @.",
      "{bill}-{v3} $> So {s} gets back @ in change."),
    T("ages_family", "n, s, o, p = P(); a, b, k = R(4, 12), R(2, 7), R(2, 4); "
      "rel = C(['brother', 'sister', 'cousin']); parent = C(['mother', 'father'])",
      "{n} is {a} years old. {p!c} {rel} is {b} years older than {o}. {p!c} {parent} is {k} times as old as {p} "
      "{rel}. What is the sum of the ages of {n}, {p} {rel}, and {p} {parent}?",
      "{a}+{b} -> {p!c} {rel} is @ years old.", "{v1}*{k} -> {p!c} {parent} is @ years old.",
      "{a}+{v1}+{v2} -> The sum of their ages is @ years."),
    T("ages_future", "n, s, o, p = P(); m, *_ = P([n]); y, k, f = R(3, 15), R(2, 5), R(2, 12)",
      "{n} is {k} times as old as {m}. If {m} is {y} years old now, how old will {n} be in {f} years?",
      "{y}*{k} -> {n} is @ years old now.", "{v1}+{f} -> In {f} years {s} will be @ years old."),
    T("train_two_legs", "vehicle = C(['train', 'bus', 'truck', 'ferry']); s1, h1 = R(4, 12) * 5, R(2, 5); "
      "s2, h2 = R(4, 12) * 5, R(2, 4); unit = C(['miles', 'kilometers']); "
      "abbr = 'mph' if unit == 'miles' else 'km/h'",
      "A {vehicle} travels at {s1} {abbr} for {h1} hours and then at {s2} {abbr} for another {h2} hours. How many "
      "{unit} does the {vehicle} travel in total?",
      "{s1}*{h1} -> In the first part it travels @ {unit}.", "{s2}*{h2} -> In the second part it travels @ {unit}.",
      "{v1}+{v2} -> In total it travels @ {unit}."),
    T("reading_days", "n, s, o, p = P(); d, k, done = R(8, 30), R(3, 12), R(10, 90); total = done + d * k",
      "{n} is reading a book with {total} pages. {s!c} has already read {done} pages. If {s} reads {d} pages every "
      "day, how many more days will it take {o} to finish the book?",
      "{total}-{done} -> {s!c} has @ pages left to read.", "{v1}/{d} -> It will take {o} @ more days."),
    T("recipe_scale", "n, s, o, p = P(); food = C(['muffins', 'pancakes', 'cupcakes', 'cookies', 'biscuits']); "
      "m = C([6, 8, 10, 12, 15, 20]); f, sug = R(2, 5), R(2, 4); mult = R(2, 6); n_food = m * mult",
      "A recipe for {m} {food} uses {f} cups of flour and {sug} cups of sugar. {n} wants to make {n_food} {food}. "
      "How many cups of flour and sugar combined will {s} need?",
      "{n_food}/{m} -> {s!c} needs to make the recipe @ times.", "{f}*{v1} -> {s!c} needs @ cups of flour.",
      "{sug}*{v1} -> {s!c} needs @ cups of sugar.", "{v2}+{v3} -> Combined that is @ cups."),
    T("weekly_savings", "n, s, o, p = P(); wk, k = R(5, 25), R(6, 20); "
      "thing = C(['a bike', 'a video game', 'a pair of shoes', 'a skateboard', 'a telescope']); "
      "spend = R(20, wk * k - 5)",
      "{n} saves ${wk} every week. After {k} weeks, {s} spends ${spend} on {thing}. How much money does {s} have "
      "left?",
      "{wk}*{k} $> After {k} weeks {s} has saved @.", "{v1}-{spend} $> After buying {thing} {s} has @ left."),
    T("savings_goal", "n, s, o, p = P(); e = R(3, 12) * 5; weeks = R(3, 15); have = R(10, 120); "
      "cost = have + e * weeks; "
      "job = C(['mowing lawns', 'walking dogs', 'washing cars', 'tutoring', 'babysitting']); "
      "thing = C(['laptop', 'guitar', 'tablet', 'camera', 'bicycle'])",
      "{n} wants to buy a {thing} that costs ${cost:,}. {s!c} already has ${have}. {s!c} earns ${e} each week from "
      "{job}. How many weeks will {s} need to work to have enough money for the {thing}?",
      "{cost}-{have} $> {s!c} still needs @.", "{v1}/{e} -> {s!c} needs to work @ weeks."),
    T("discount", "n, s, o, p = P(); item = C(['jacket', 'pair of boots', 'backpack', 'lamp', 'sweater', 'watch']); "
      "pct = C([10, 20, 25, 30, 40, 50]); price = R(2, 12) * 20; k = R(2, 4)",
      "A {item} normally costs ${price}. During a sale, the store takes {pct}% off the price. How much does {n} pay "
      "for {k} of them during the sale?",
      "{price}*{pct}/100 $> The discount is @ per item.", "{price}-{v1} $> The sale price is @.",
      "{v2}*{k} $> {n} pays @ in total."),
    T("tip_split", "bill = R(3, 15) * 20; tip = C([10, 15, 20, 25]); total = bill * (100 + tip) // 100; "
      "retry_if(bill * (100 + tip) % 100); divisors = [d for d in range(2, 9) if total % d == 0]; "
      "retry_if(not divisors); people = C(divisors); meal = C(['dinner', 'lunch', 'brunch'])",
      "{people} friends go out for {meal}. The bill comes to ${bill}, and they leave a {tip}% tip. If they split "
      "the total evenly, how much does each friend pay?",
      "{bill}*{tip}/100 $> The tip is @.", "{bill}+{v1} $> The total is @.", "{v2}/{people} $> Each friend pays @."),
    T("school_clubs", "total = R(2, 12) * 15 * C([1, 2, 4]); place = C(['school', 'summer camp', 'sports center'])",
      "A {place} has {total} children. Two fifths of them play soccer, and one third of the rest play basketball. "
      "The others do not play any sport. How many children do not play any sport?",
      "{total}*2/5 -> @ children play soccer.", "{total}-{v1} -> That leaves @ children.",
      "{v2}/3 -> @ children play basketball.", "{v2}-{v3} -> So @ children do not play any sport."),
    T("factory_machines", "thing = C(['bottles', 'toys', 'bolts', 'cans', 'boxes']); "
      "rate, m, h, d = R(5, 30), R(2, 6), R(4, 10), R(2, 6)",
      "A machine makes {rate} {thing} per hour. A factory runs {m} of these machines for {h} hours a day. How many "
      "{thing} does the factory make in {d} days?",
      "{rate}*{m} -> The machines make @ {thing} per hour together.", "{v1}*{h} -> In one day they make @ {thing}.",
      "{v2}*{d} -> In {d} days they make @ {thing}."),
    T("painters_together", "a, *_ = P(); b, *_ = P([a]); r1, r2 = R(2, 5), R(2, 5); k = R(2, 9); "
      "rooms = (r1 + r2) * k; "
      "job = C([('paints', 'rooms'), ('builds', 'fences'), ('cleans', 'offices'), ('repairs', 'bicycles')])",
      "{a} {job[0]} {r1} {job[1]} per day and {b} {job[0]} {r2} {job[1]} per day. Working together, how many days "
      "will it take them to finish {rooms} {job[1]}?",
      "{r1}+{r2} -> Together they finish @ {job[1]} per day.", "{rooms}/{v1} -> It will take them @ days."),
    T("fence_cost", "L, W, c = R(8, 40), R(5, 30), R(3, 15); area = C(['garden', 'yard', 'playground', 'pasture'])",
      "A rectangular {area} is {L} meters long and {W} meters wide. Fencing costs ${c} per meter. How much will it "
      "cost to put a fence all the way around the {area}?",
      "2*({L}+{W}) -> The perimeter is @ meters.", "{v1}*{c} $> The fence will cost @."),
    T("tile_boxes", "L, W = R(6, 25), R(6, 20); area = L * W; "
      "boxes = [b for b in (5, 6, 8, 10, 12, 15, 20) if area % b == 0]; retry_if(not boxes); b = C(boxes); "
      "n, s, o, p = P()",
      "{n} is tiling a floor that measures {L} feet by {W} feet. Each tile covers one square foot, and tiles come "
      "in boxes of {b}. How many boxes of tiles does {s} need?",
      "{L}*{W} -> The floor has an area of @ square feet, so {s} needs {v1} tiles.",
      "{v1}/{b} -> {s!c} needs @ boxes."),
    T("shirt_inventory", "item = C(['shirts', 'hats', 'mugs', 'umbrellas', 'scarves']); start = R(300, 2500); "
      "a, b = R(40, start // 4), R(30, start // 4); c = R(100, 900)",
      "A store has {start:,} {item} in stock. It sells {a} {item} on Monday and {b} on Tuesday. On Wednesday a "
      "shipment of {c} more {item} arrives. How many {item} does the store have now?",
      "{start}-{a} -> After Monday the store has @ {item}.", "{v1}-{b} -> After Tuesday it has @ {item}.",
      "{v2}+{c} -> After the shipment it has @ {item}."),
    T("warehouse_boxes", "item = C(['cans of soup', 'light bulbs', 'books', 'jars of jam', 'soap bars']); "
      "boxes, per = R(20, 90), C([12, 24, 36, 48, 50]); total = boxes * per; out = R(total // 5, total * 4 // 5)",
      "A warehouse has {boxes} boxes with {per} {item} in each box. A truck takes away {out:,} {item}. How many "
      "{item} are left in the warehouse?",
      "{boxes}*{per} -> The warehouse starts with @ {item}.",
      "{v1}-{out} -> After the truck leaves, @ {item} are left."),
    T("practice_hours", "n, s, o, p = P(); act = C(['piano', 'violin', 'basketball', 'chess', 'drawing']); "
      "m, e = C([30, 40, 45, 60, 75, 90]), C([30, 60, 90, 120, 150]); retry_if((5 * m + 2 * e) % 60)",
      "{n} practices {act} for {m} minutes each weekday and for {e} minutes on each day of the weekend. How many "
      "hours does {s} practice {act} in a week?",
      "5*{m} -> On weekdays {s} practices @ minutes.", "2*{e} -> On the weekend {s} practices @ minutes.",
      "{v1}+{v2} -> That is @ minutes in total.", "{v3}/60 -> This is @ hours."),
    T("movie_minutes", "n, s, o, p = P(); h, m, k = R(1, 3), R(5, 55), R(2, 6); "
      "show = C(['movie', 'play', 'concert recording', 'documentary']); hrs = 'hour' if h == 1 else 'hours'",
      "{n}'s favorite {show} is {h} {hrs} and {m} minutes long. {s!c} has watched it {k} times. How many minutes "
      "has {s} spent watching it?",
      "{h}*60 -> {h} {hrs} is @ minutes.", "{v1}+{m} -> The {show} is @ minutes long.",
      "{v2}*{k} -> {s!c} has spent @ minutes watching it."),
    T("fuel_cost", "n, s, o, p = P(); mpg = C([20, 25, 30, 35, 40]); dist = mpg * R(3, 30); price = R(3, 5)",
      "{n}'s car can drive {mpg} miles on one gallon of gas. {s!c} is planning a trip of {dist:,} miles, and gas "
      "costs ${price} per gallon. How much will {s} spend on gas?",
      "{dist}/{mpg} -> {s!c} needs @ gallons of gas.", "{v1}*{price} $> The gas will cost @."),
    T("cookie_bags", "n, s, o, p = P(); batches, per = R(2, 9), C([12, 18, 24, 30, 36]); total = batches * per; "
      "bags = [b for b in (3, 4, 5, 6, 8, 9, 10) if total % b == 0]; k = C(bags); "
      "treat = C(['cookies', 'brownies', 'cinnamon rolls', 'macarons'])",
      "{n} bakes {batches} batches of {treat} with {per} {treat} in each batch. {s!c} packs them into bags of {k}. "
      "How many bags can {s} fill?",
      "{batches}*{per} -> {s!c} bakes @ {treat}.", "{v1}/{k} -> {s!c} can fill @ bags."),
    T("pizza_leftover", "n, s, o, p = P(); pizzas, slices = R(2, 7), C([6, 8, 10, 12]); "
      "friends, each = R(2, 6), R(2, 4); retry_if((friends + 1) * each >= pizzas * slices)",
      "{n} orders {pizzas} pizzas for a party. Each pizza is cut into {slices} slices. {s!c} and {p} {friends} "
      "friends each eat {each} slices. How many slices are left over?",
      "{pizzas}*{slices} -> There are @ slices in total.", "{friends}+1 -> There are @ people eating.",
      "{v2}*{each} -> They eat @ slices.", "{v1}-{v3} -> There are @ slices left over."),
    T("babysitting_half", "n, s, o, p = P(); rate, h, wk = R(8, 20), R(2, 6), R(2, 8); retry_if(rate * h * wk % 2); "
      "job = C(['babysitting', 'tutoring', 'dog walking', 'working at a cafe'])",
      "{n} earns ${rate} per hour {job}. {s!c} works {h} hours every weekend. After {wk} weekends, {s} spends half "
      "of the money on clothes. How much money does {s} have left?",
      "{rate}*{h} $> Each weekend {s} earns @.", "{v1}*{wk} $> After {wk} weekends {s} has @.",
      "{v2}/2 $> After spending half, {s} has @ left."),
    T("overtime", "n, s, o, p = P(); rate = R(6, 15) * 2; hours = R(42, 55)",
      "{n} earns ${rate} an hour for the first 40 hours {s} works each week and 1.5 times that rate for every hour "
      "after that. How much does {s} earn in a week when {s} works {hours} hours?",
      "40*{rate} $> For the first 40 hours {s} earns @.", "{hours}-40 -> {s!c} works @ hours of overtime.",
      "{rate}*1.5 $> The overtime rate is @ per hour.", "{v2}*{v3} $> Overtime pays @.",
      "{v1}+{v4} $> In total {s} earns @."),
    T("population_growth", "pct = C([5, 10, 12, 15, 20, 25]); pop = R(4, 90) * 100; retry_if(pop * pct % 100); "
      "town = C(['Millbrook', 'Cedar Falls', 'Riverton', 'Oakdale', 'Pine Hollow'])",
      "The town of {town} had {pop:,} residents last year. This year the population grew by {pct}%. How many "
      "residents does {town} have now?",
      "{pop}*{pct}/100 -> The population grew by @ people.", "{pop}+{v1} -> {town} now has @ residents."),
    T("test_needed", "n, s, o, p = P(); goal = R(75, 92); scores = [R(65, 100) for _ in range(3)]; "
      "need = goal * 4 - sum(scores); retry_if(not 50 <= need <= 100)",
      "{n} scored {scores[0]}, {scores[1]}, and {scores[2]} on {p} first three math tests. What score does {s} need "
      "on the fourth test to have an average of {goal}?",
      "{goal}*4 -> To average {goal}, {s} needs @ points in total.",
      "{scores[0]}+{scores[1]}+{scores[2]} -> So far {s} has @ points.",
      "{v1}-{v2} -> {s!c} needs a score of @ on the fourth test."),
    T("average_run", "n, s, o, p = P(); avg = R(3, 9); days = [R(2, 12) for _ in range(3)]; "
      "last = avg * 4 - sum(days); retry_if(last < 2); days.append(last); unit = C(['miles', 'kilometers']); "
      "dsum = '+'.join((str(d) for d in days))",
      "{n} runs {days[0]} {unit} on Monday, {days[1]} on Tuesday, {days[2]} on Wednesday, and {days[3]} on "
      "Thursday. What is the average distance {s} runs per day?",
      "{dsum} -> {s!c} runs @ {unit} in total.", "{v1}/4 -> The average is @ {unit} per day."),
    T("fruit_basket", "total = 12 * R(2, 15)",
      "A fruit stand has {total} pieces of fruit. One quarter of them are apples, one third are oranges, and the "
      "rest are bananas. How many bananas are there?",
      "{total}/4 -> There are @ apples.", "{total}/3 -> There are @ oranges.",
      "{v1}+{v2} -> Apples and oranges make @ pieces of fruit.", "{total}-{v3} -> There are @ bananas."),
    T("theater_tickets", "adult, child = R(8, 20), R(3, 7); na, nc = R(50, 400), R(40, 300); "
      "venue = C(['theater', 'museum', 'zoo', 'aquarium'])",
      "Adult tickets to the {venue} cost ${adult} and child tickets cost ${child}. On Saturday the {venue} sold "
      "{na} adult tickets and {nc} child tickets. How much money did the {venue} make on Saturday?",
      "{na}*{adult} $> Adult tickets brought in @.", "{nc}*{child} $> Child tickets brought in @.",
      "{v1}+{v2} $> The {venue} made @ on Saturday."),
    T("tomato_rows", "n, s, o, p = P(); rows, per, each = R(3, 10), R(4, 12), R(5, 20); crop = C([('tomato plants', "
      "'tomatoes'), ('pepper plants', 'peppers'), ('strawberry plants', 'strawberries'), ('bean plants', 'beans')])",
      "{n} plants {rows} rows of {crop[0]} with {per} plants in each row. Each plant produces {each} {crop[1]}. How "
      "many {crop[1]} does {s} harvest?",
      "{rows}*{per} -> {s!c} has @ plants.", "{v1}*{each} -> {s!c} harvests @ {crop[1]}."),
    T("stamp_share", "n, s, o, p = P(); start, m, k = R(20, 200), R(5, 30), R(2, 12); x = C([2, 3, 4, 5]); "
      "total = start + m * k; retry_if(total % x); rel = C(RELATIVES_F if r.random() < 0.5 else RELATIVES_M); "
      "frac = {2: 'half', 3: 'one third', 4: 'one quarter', 5: 'one fifth'}[x]; "
      "thing = C(['stamps', 'stickers', 'coins', 'trading cards'])",
      "{n} has {start} {thing}. Every month {s} adds {m} more to {p} collection. After {k} months, {s} gives {frac} "
      "of {p} {thing} to {p} {rel}. How many {thing} does {n} have left?",
      "{m}*{k} -> {s!c} adds @ {thing}.", "{start}+{v1} -> {s!c} then has @ {thing}.",
      "{v2}/{x} -> {s!c} gives away @ {thing}.", "{v2}-{v3} -> {s!c} has @ {thing} left."),
    T("square_area", "side = R(3, 40); per = side * 4; "
      "thing = C(['square garden', 'square rug', 'square field', 'square patio']); "
      "unit = C(['feet', 'meters', 'yards'])",
      "A {thing} has a perimeter of {per} {unit}. What is its area in square {unit}?",
      "{per}/4 -> Each side is @ {unit} long.", "{v1}*{v1} -> The area is @ square {unit}."),
    T("poster_cutout", "L, W = R(20, 60), R(15, 50); side = R(3, min(L, W) - 2)",
      "A rectangular piece of cardboard is {L} cm long and {W} cm wide. A square hole with sides of {side} cm is "
      "cut out of it. What is the area of the cardboard that is left, in square centimeters?",
      "{L}*{W} -> The whole piece has an area of @ square cm.",
      "{side}*{side} -> The hole has an area of @ square cm.", "{v1}-{v2} -> The remaining area is @ square cm."),
    T("cyclist_rate", "n, s, o, p = P(); speed, h, h2 = R(8, 25), R(2, 5), R(3, 9); retry_if(h2 == h); "
      "dist = speed * h; mode = C(['rides a bike', 'rows a boat', 'skates', 'jogs'])",
      "{n} {mode} {dist} kilometers in {h} hours. At the same speed, how many kilometers can {s} cover in {h2} "
      "hours?",
      "{dist}/{h} -> {s!c} covers @ kilometers per hour.", "{v1}*{h2} -> In {h2} hours {s} covers @ kilometers."),
    T("opposite_cars", "a, b, h = R(30, 70), R(30, 70), R(2, 6)",
      "Two cars leave the same gas station at the same time and drive in opposite directions. One drives at {a} "
      "miles per hour and the other at {b} miles per hour. How far apart are they after {h} hours?",
      "{a}*{h} -> The first car drives @ miles.", "{b}*{h} -> The second car drives @ miles.",
      "{v1}+{v2} -> They are @ miles apart."),
    T("homework_minutes", "n, s, o, p = P(); math, read = R(15, 50), R(10, 40); k = C([2, 3]); "
      "times = {2: 'twice', 3: 'three times'}[k]",
      "{n} spends {math} minutes on math homework and {read} minutes on reading. {s!c} spends {times} as long on "
      "science as on math. How many minutes does {s} spend on homework in total?",
      "{math}*{k} -> {s!c} spends @ minutes on science.",
      "{math}+{read}+{v1} -> In total {s} spends @ minutes on homework."),
    T("sleep_week", "n, s, o, p = P(); h, extra = R(6, 9), R(2, 3)",
      "{n} sleeps {h} hours each night from Monday to Friday. On Saturday and Sunday {s} sleeps {extra} hours more "
      "each night. How many hours does {s} sleep in a week?",
      "5*{h} -> On weeknights {s} sleeps @ hours.", "{h}+{extra} -> On weekend nights {s} sleeps @ hours each.",
      "2*{v2} -> Over the weekend {s} sleeps @ hours.", "{v1}+{v3} -> In a week {s} sleeps @ hours."),
    T("tank_fill", "rate, mins = R(5, 40), R(5, 60); start = R(20, 400); cap_l = start + rate * mins; "
      "tank = C(['water tank', 'swimming pool', 'fish tank', 'rain barrel'])",
      "A {tank} holds {cap_l:,} liters. It already has {start} liters in it. A hose adds {rate} liters every "
      "minute. How many minutes will it take to fill the {tank}?",
      "{cap_l}-{start} -> The {tank} needs @ more liters.", "{v1}/{rate} -> It will take @ minutes."),
    T("bus_seats", "cap_s = C([40, 45, 50, 55, 60]); a = R(15, 35); off, on = R(3, a - 5), R(5, 25); "
      "retry_if(a - off + on >= cap_s)",
      "A bus has {cap_s} seats. At the first stop {a} passengers get on. At the second stop {off} passengers get "
      "off and {on} passengers get on. If every passenger takes a seat, how many seats are empty now?",
      "{a}-{off} -> After people get off there are @ passengers.",
      "{v1}+{on} -> After new passengers get on there are @ passengers.", "{cap_s}-{v2} -> There are @ empty seats."),
    T("library_mysteries", "books = 24 * R(10, 250)",
      "A library has {books:,} books. Three eighths of the books are fiction, and one third of the fiction books "
      "are mysteries. How many mystery books does the library have?",
      "{books}*3/8 -> The library has @ fiction books.", "{v1}/3 -> It has @ mystery books."),
    T("coin_jar", "n, s, o, p = P(); qn, d, nk = R(3, 30), R(2, 25), R(2, 20)",
      "{n} has {qn} quarters, {d} dimes, and {nk} nickels in {p} piggy bank. How many cents does {s} have in total?",
      "{qn}*25 -> The quarters are worth @ cents.", "{d}*10 -> The dimes are worth @ cents.",
      "{nk}*5 -> The nickels are worth @ cents.", "{v1}+{v2}+{v3} -> {s!c} has @ cents in total."),
    T("farm_legs", "n, s, o, p = P(); birds, beasts = R(5, 40), R(3, 25); "
      "bird = C(['chickens', 'ducks', 'geese', 'turkeys']); beast = C(['cows', 'goats', 'sheep', 'pigs', 'horses'])",
      "{n}'s farm has {birds} {bird} and {beasts} {beast}. How many legs do the animals on the farm have altogether?",
      "{birds}*2 -> The {bird} have @ legs.", "{beasts}*4 -> The {beast} have @ legs.",
      "{v1}+{v2} -> Altogether the animals have @ legs."),
    T("pack_price", "n, s, o, p = P(); k = C([4, 5, 6, 8, 10, 12]); price = R(2, 9); need = k * R(3, 15); "
      "item = C(['pencils', 'batteries', 'yogurt cups', 'tennis balls', 'candles'])",
      "A pack of {k} {item} costs ${price}. {n} needs {need} {item} for a school event. How much will {s} spend on "
      "{item}?",
      "{need}/{k} -> {s!c} needs @ packs.", "{v1}*{price} $> {s!c} will spend @."),
    T("gym_year", "n, s, o, p = P(); fee, month = R(2, 10) * 10, R(15, 60); "
      "rel = C(RELATIVES_F if r.random() < 0.5 else RELATIVES_M)",
      "A gym charges a one-time sign-up fee of ${fee} and ${month} per month. {n} and {p} {rel} both join the gym. "
      "How much do they pay together for the first year?",
      "{month}*12 $> Twelve months cost @ for one person.", "{v1}+{fee} $> With the sign-up fee, one person pays @.",
      "{v2}*2 $> Together they pay @."),
    T("marble_share", "a, *_ = P(); b, *_ = P([a]); x, k = R(5, 40), R(2, 5); friends = C([2, 3, 4, 5, 6]); "
      "total = x + x * k; retry_if(total % friends); thing = C(['marbles', 'seashells', 'beads', 'crayons'])",
      "{a} has {x} {thing}. {b} has {k} times as many {thing} as {a}. They put all their {thing} together and share "
      "them equally among {friends} friends. How many {thing} does each friend get?",
      "{x}*{k} -> {b} has @ {thing}.", "{x}+{v1} -> Together they have @ {thing}.",
      "{v2}/{friends} -> Each friend gets @ {thing}."),
    T("lemonade_profit", "n, s, o, p = P(); price, cups = R(2, 5), R(20, 120); cost = R(8, 40); "
      "retry_if(price * cups <= cost); stand = C(['lemonade', 'iced tea', 'hot cocoa', 'fruit punch']); "
      "article = 'an' if stand[0] in 'aeiou' else 'a'",
      "{n} runs {article} {stand} stand. {s!c} spends ${cost} on supplies and sells each cup for ${price}. If {s} "
      "sells {cups} cups, how much profit does {s} make?",
      "{cups}*{price} $> {s!c} earns @ from sales.", "{v1}-{cost} $> {s!c} makes a profit of @."),
    T("rainfall", "a, less = R(4, 30), R(2, 8); town = C(['Springfield', 'Lakeside', 'Hillview', 'Brookport'])",
      "In {town} it rained {a} millimeters on Monday. On Tuesday it rained twice as much as on Monday, and on "
      "Wednesday it rained {less} millimeters less than on Tuesday. How many millimeters of rain fell over the "
      "three days?",
      "{a}*2 -> On Tuesday it rained @ millimeters.", "{v1}-{less} -> On Wednesday it rained @ millimeters.",
      "{a}+{v1}+{v2} -> In total @ millimeters of rain fell."),
    T("paint_cans", "n, s, o, p = P(); L, H = R(8, 30), R(8, 12); walls = C([2, 3, 4]); "
      "cover = C([20, 25, 40, 50, 60, 80, 100]); area = L * H * walls; retry_if(area % cover)",
      "{n} wants to paint {walls} walls. Each wall is {L} feet wide and {H} feet tall. One can of paint covers "
      "{cover} square feet. How many cans of paint does {s} need?",
      "{L}*{H} -> Each wall has an area of @ square feet.",
      "{v1}*{walls} -> All the walls have an area of @ square feet.", "{v2}/{cover} -> {s!c} needs @ cans of paint."),
    T("defective_toys", "made = R(10, 90) * 100; pct = C([2, 3, 4, 5, 6, 8, 10]); "
      "thing = C(['toys', 'phone cases', 'light bulbs', 'water bottles'])",
      "A factory made {made:,} {thing} last week. {pct}% of them were defective and had to be thrown away. How many "
      "{thing} were not defective?",
      "{made}*{pct}/100 -> @ {thing} were defective.", "{made}-{v1} -> @ {thing} were not defective."),
    T("commission", "n, s, o, p = P(); base = R(10, 30) * 100; pct = C([2, 4, 5, 10]); sales = R(10, 80) * 500",
      "{n} is a salesperson who earns a base salary of ${base:,} per month plus a {pct}% commission on {p} sales. "
      "Last month {s} sold ${sales:,} worth of furniture. How much did {s} earn last month?",
      "{sales}*{pct}/100 $> {p!c} commission was @.", "{base}+{v1} $> {s!c} earned @ in total."),
    T("rent_split", "rent = R(12, 40) * 100; util = R(6, 30) * 10; people = C([2, 3, 4, 5]); total = rent + util; "
      "retry_if(total % people)",
      "{people} roommates share an apartment. The rent is ${rent:,} per month and the utilities are ${util} per "
      "month. If they split everything equally, how much does each roommate pay per month?",
      "{rent}+{util} $> The total monthly cost is @.", "{v1}/{people} $> Each roommate pays @."),
    T("egg_cartons", "n, s, o, p = P(); hens, eggs, weeks = R(6, 30), R(3, 7), R(2, 4); "
      "total = hens * eggs * weeks; retry_if(total % 12); price = R(3, 6)",
      "{n} has {hens} hens, and each hen lays {eggs} eggs a week. After {weeks} weeks {s} packs all the eggs into "
      "cartons of a dozen and sells each carton for ${price}. How much money does {s} make?",
      "{hens}*{eggs} -> The hens lay @ eggs a week.", "{v1}*{weeks} -> In {weeks} weeks they lay @ eggs.",
      "{v2}/12 -> That fills @ cartons.", "{v3}*{price} $> {s!c} makes @."),
    T("steps_walk", "n, s, o, p = P(); steps, days = R(30, 120) * 100, R(3, 7); goal = steps * days + R(5, 60) * 100",
      "{n} walks {steps:,} steps every day. {p!c} goal for the week is {goal:,} steps. After {days} days, how many "
      "more steps does {s} need to reach {p} goal?",
      "{steps}*{days} -> After {days} days {s} has walked @ steps.", "{goal}-{v1} -> {s!c} needs @ more steps."),
    T("concert_chairs", "rows, per = R(10, 40), R(12, 30); sold = R(rows * per // 3, rows * per - 10)",
      "A concert hall has {rows} rows of seats with {per} seats in each row. {sold:,} tickets have been sold so "
      "far. How many seats are still available?",
      "{rows}*{per} -> The hall has @ seats.", "{v1}-{sold} -> @ seats are still available."),
    T("phone_plan", "n, s, o, p = P(); base, incl = R(20, 50), R(2, 10); extra = R(3, 10); used = incl + R(1, 8); "
      "months = R(2, 6)",
      "{n}'s phone plan costs ${base} per month and includes {incl} GB of data. Each extra GB costs ${extra}. If "
      "{s} uses {used} GB every month, how much does {s} pay over {months} months?",
      "{used}-{incl} -> {s!c} uses @ extra GB each month.", "{v1}*{extra} $> The extra data costs @ per month.",
      "{base}+{v2} $> Each month {s} pays @.", "{v3}*{months} $> Over {months} months {s} pays @."),
    T("aquarium_fish", "n, s, o, p = P(); tanks, fish = R(2, 8), R(4, 15); bought, died = R(3, 20), R(2, 6)",
      "{n} has {tanks} fish tanks with {fish} fish in each tank. {s!c} buys {bought} more fish and then gives "
      "{died} fish to a friend. How many fish does {n} have now?",
      "{tanks}*{fish} -> {s!c} starts with @ fish.", "{v1}+{bought} -> After buying more, {s} has @ fish.",
      "{v2}-{died} -> {s!c} now has @ fish."),
]


def make_row(template: Template, rng: random.Random) -> dict[str, str]:
    """Draw one problem from ``template``, retrying until the numbers work out."""
    for _ in range(MAX_TRIES):
        try:
            question, lines, value = draw(template, rng)
        except Retry:
            continue
        if not 2 <= len(lines) <= 5:
            raise AssertionError(f"{template.name}: bad number of steps")
        return {"question": question, "answer": "\n".join(lines + [f"#### {value}"])}
    raise RuntimeError(f"{template.name}: could not draw valid numbers")


def build_splits(seed: int = SEED) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Return (train_rows, test_rows); no question is repeated within or across splits."""
    rng = random.Random(seed)
    seen = set()

    def rows(count: int) -> list[dict[str, str]]:
        out = []
        for i in range(count):
            template = TEMPLATES[i % len(TEMPLATES)]
            for _ in range(MAX_TRIES):
                row = make_row(template, rng)
                if row["question"] not in seen:
                    break
            else:
                raise RuntimeError(f"{template.name}: too many duplicate questions")
            seen.add(row["question"])
            out.append(row)
        rng.shuffle(out)
        return out

    train = rows(N_TRAIN)
    return train, rows(N_TEST)


def write_splits(out_dir: Path | str = DEFAULT_OUT_DIR, seed: int = SEED) -> tuple[Path, Path]:
    """Build both splits and write ``train.jsonl`` and ``test.jsonl`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / TRAIN_FILE, out / TEST_FILE
    for path, rows in zip(paths, build_splits(seed)):
        with open(path, "w", encoding="utf-8", newline="\n") as fh:
            fh.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR,
                        help="directory to write train.jsonl and test.jsonl into")
    train_path, test_path = write_splits(parser.parse_args(argv).out_dir)
    print(f"wrote {N_TRAIN} rows to {train_path}")
    print(f"wrote {N_TEST} rows to {test_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
