#!/usr/bin/env python3
"""Generate the small GSM8K-style sample embedded in ``lowmem_grpo``.

The problems are written for this project from templates (they are not copied
from GSM8K), but follow GSM8K's format exactly: every row is
``{"question": str, "answer": str}``; the answer is a worked solution with one
reasoning step per line, each computation carrying a calculator annotation
such as ``3*4=<<3*4=12>>12``, and a final line ``#### N``.

The output is fully deterministic (fixed seed, standard library only)::

    python tools/make_embedded_gsm8k.py                 # writes into the package
    python tools/make_embedded_gsm8k.py --out-dir /tmp/x
"""

from __future__ import annotations

import argparse
import ast
import json
import random
from fractions import Fraction
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

SEED = 20240817
N_TRAIN = 240
N_TEST = 120
TRAIN_FILE = "train.jsonl"
TEST_FILE = "test.jsonl"
MAX_TRIES = 2000

DEFAULT_OUT_DIR = (
    Path(__file__).resolve().parents[1] / "lowmem_grpo" / "resources" / "gsm8k"
)


# --------------------------------------------------------------------------
# exact arithmetic
# --------------------------------------------------------------------------

_ALLOWED_CHARS = set("0123456789+-*/(). ")


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
            val = ev(node.operand)
            return val if isinstance(node.op, ast.UAdd) else -val
        if isinstance(node, ast.BinOp):
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            if isinstance(node.op, ast.Div):
                return left / right
        raise ValueError(f"unsupported syntax in expression: {expr!r}")

    return ev(ast.parse(expr, mode="eval"))


class Retry(Exception):
    """Raised by a template when the drawn numbers do not work out."""


class Work:
    """Collects the lines of a worked solution."""

    def __init__(self) -> None:
        self.lines: List[str] = []
        self.last: int | None = None

    def c(self, expr: str, money: bool = False) -> Tuple[str, int]:
        """Return (annotated text, value) for ``expr``; value must be a positive int."""
        val = evaluate(expr)
        if val.denominator != 1 or val <= 0:
            raise Retry(expr)
        v = int(val)
        self.last = v
        if money:
            text = f"${expr}=$<<{expr}={v}>>{v}"
        else:
            text = f"{expr}=<<{expr}={v}>>{v}"
        return text, v

    def say(self, line: str) -> None:
        self.lines.append(line)

    def step(self, expr: str, line: str, money: bool = False) -> int:
        """Add `line` with its `@` replaced by the annotated calculation of `expr`; return the value."""
        text, value = self.c(expr, money)
        self.say(line.replace("@", text))
        return value


# --------------------------------------------------------------------------
# vocabulary
# --------------------------------------------------------------------------

# (name, subject pronoun, object pronoun, possessive pronoun)
PEOPLE = [
    ("Maya", "she", "her", "her"), ("Liam", "he", "him", "his"),
    ("Priya", "she", "her", "her"), ("Carlos", "he", "him", "his"),
    ("Hannah", "she", "her", "her"), ("Kenji", "he", "him", "his"),
    ("Amara", "she", "her", "her"), ("Oliver", "he", "him", "his"),
    ("Sofia", "she", "her", "her"), ("Mateo", "he", "him", "his"),
    ("Chloe", "she", "her", "her"), ("Darius", "he", "him", "his"),
    ("Lena", "she", "her", "her"), ("Ethan", "he", "him", "his"),
    ("Fatima", "she", "her", "her"), ("Noah", "he", "him", "his"),
    ("Grace", "she", "her", "her"), ("Ravi", "he", "him", "his"),
    ("Isabel", "she", "her", "her"), ("Tobias", "he", "him", "his"),
    ("Zoe", "she", "her", "her"), ("Marcus", "he", "him", "his"),
    ("Nadia", "she", "her", "her"), ("Felix", "he", "him", "his"),
    ("Ruby", "she", "her", "her"), ("Omar", "he", "him", "his"),
    ("Elena", "she", "her", "her"), ("Samuel", "he", "him", "his"),
    ("Ingrid", "she", "her", "her"), ("Jamal", "he", "him", "his"),
    ("Keiko", "she", "her", "her"), ("Victor", "he", "him", "his"),
    ("Aisha", "she", "her", "her"), ("Lucas", "he", "him", "his"),
    ("Bianca", "she", "her", "her"), ("Henry", "he", "him", "his"),
]

RELATIVES_F = ["sister", "aunt", "cousin", "grandmother", "neighbor"]
RELATIVES_M = ["brother", "uncle", "cousin", "grandfather", "neighbor"]


def person(r: random.Random, exclude: Sequence[str] = ()) -> Tuple[str, str, str, str]:
    while True:
        p = r.choice(PEOPLE)
        if p[0] not in exclude:
            return p


def fmt(r: random.Random, n: int) -> str:
    """Write an integer for the question text, sometimes with thousands commas."""
    if n >= 1000 and r.random() < 0.7:
        return f"{n:,}"
    return str(n)


def cap(s: str) -> str:
    return s[0].upper() + s[1:]


def smallest_bill(total: int) -> int:
    for bill in (10, 20, 50, 100, 200, 500):
        if bill > total:
            return bill
    raise Retry("total too large")


# --------------------------------------------------------------------------
# templates: each takes a Random and returns (question, Work)
# --------------------------------------------------------------------------

Template = Callable[[random.Random], Tuple[str, Work]]


def t_school_supplies(r):
    n, s, o, p = person(r)
    item1, item2 = r.choice([("notebooks", "pens"), ("folders", "markers"),
                             ("erasers", "pencils"), ("binders", "highlighters")])
    a, pa = r.randint(2, 6), r.randint(2, 7)
    b, pb = r.randint(2, 8), r.randint(2, 4)
    w = Work()
    v1 = w.step(f"{a}*{pa}", f"The {item1} cost @.", True)
    v2 = w.step(f"{b}*{pb}", f"The {item2} cost @.", True)
    v3 = w.step(f"{v1}+{v2}", f"Altogether {s} spends @.", True)
    bill = smallest_bill(v3)
    q = (f"{n} buys {a} {item1} that cost ${pa} each and {b} {item2} that cost ${pb} each. "
         f"If {s} pays with a ${bill} bill, how much change does {s} get back?")
    w.step(f"{bill}-{v3}", f"So {s} gets back @ in change.", True)
    return q, w


def t_ages_family(r):
    n, s, o, p = person(r)
    a, b, k = r.randint(4, 12), r.randint(2, 7), r.randint(2, 4)
    rel = r.choice(["brother", "sister", "cousin"])
    parent = r.choice(["mother", "father"])
    q = (f"{n} is {a} years old. {cap(p)} {rel} is {b} years older than {o}. "
         f"{cap(p)} {parent} is {k} times as old as {p} {rel}. "
         f"What is the sum of the ages of {n}, {p} {rel}, and {p} {parent}?")
    w = Work()
    v1 = w.step(f"{a}+{b}", f"{cap(p)} {rel} is @ years old.")
    v2 = w.step(f"{v1}*{k}", f"{cap(p)} {parent} is @ years old.")
    w.step(f"{a}+{v1}+{v2}", "The sum of their ages is @ years.")
    return q, w


def t_ages_future(r):
    n, s, o, p = person(r)
    m, *_ = person(r, [n])
    y, k, f = r.randint(3, 15), r.randint(2, 5), r.randint(2, 12)
    q = (f"{n} is {k} times as old as {m}. If {m} is {y} years old now, "
         f"how old will {n} be in {f} years?")
    w = Work()
    v1 = w.step(f"{y}*{k}", f"{n} is @ years old now.")
    w.step(f"{v1}+{f}", f"In {f} years {s} will be @ years old.")
    return q, w


def t_train_two_legs(r):
    vehicle = r.choice(["train", "bus", "truck", "ferry"])
    s1, h1 = r.randint(4, 12) * 5, r.randint(2, 5)
    s2, h2 = r.randint(4, 12) * 5, r.randint(2, 4)
    unit = r.choice(["miles", "kilometers"])
    abbr = "mph" if unit == "miles" else "km/h"
    q = (f"A {vehicle} travels at {s1} {abbr} for {h1} hours and then at {s2} {abbr} "
         f"for another {h2} hours. How many {unit} does the {vehicle} travel in total?")
    w = Work()
    v1 = w.step(f"{s1}*{h1}", f"In the first part it travels @ {unit}.")
    v2 = w.step(f"{s2}*{h2}", f"In the second part it travels @ {unit}.")
    w.step(f"{v1}+{v2}", f"In total it travels @ {unit}.")
    return q, w


def t_reading_days(r):
    n, s, o, p = person(r)
    d, k, done = r.randint(8, 30), r.randint(3, 12), r.randint(10, 90)
    total = done + d * k
    q = (f"{n} is reading a book with {total} pages. {cap(s)} has already read {done} pages. "
         f"If {s} reads {d} pages every day, how many more days will it take {o} to finish the book?")
    w = Work()
    v1 = w.step(f"{total}-{done}", f"{cap(s)} has @ pages left to read.")
    w.step(f"{v1}/{d}", f"It will take {o} @ more days.")
    return q, w


def t_recipe_scale(r):
    n, s, o, p = person(r)
    food = r.choice(["muffins", "pancakes", "cupcakes", "cookies", "biscuits"])
    m = r.choice([6, 8, 10, 12, 15, 20])
    f, sug = r.randint(2, 5), r.randint(2, 4)
    mult = r.randint(2, 6)
    n_food = m * mult
    q = (f"A recipe for {m} {food} uses {f} cups of flour and {sug} cups of sugar. "
         f"{n} wants to make {n_food} {food}. How many cups of flour and sugar combined will {s} need?")
    w = Work()
    v1 = w.step(f"{n_food}/{m}", f"{cap(s)} needs to make the recipe @ times.")
    v2 = w.step(f"{f}*{v1}", f"{cap(s)} needs @ cups of flour.")
    v3 = w.step(f"{sug}*{v1}", f"{cap(s)} needs @ cups of sugar.")
    w.step(f"{v2}+{v3}", "Combined that is @ cups.")
    return q, w


def t_weekly_savings(r):
    n, s, o, p = person(r)
    wk, k = r.randint(5, 25), r.randint(6, 20)
    thing = r.choice(["a bike", "a video game", "a pair of shoes", "a skateboard", "a telescope"])
    spend = r.randint(20, wk * k - 5)
    q = (f"{n} saves ${wk} every week. After {k} weeks, {s} spends ${spend} on {thing}. "
         f"How much money does {s} have left?")
    w = Work()
    v1 = w.step(f"{wk}*{k}", f"After {k} weeks {s} has saved @.", True)
    w.step(f"{v1}-{spend}", f"After buying {thing} {s} has @ left.", True)
    return q, w


def t_savings_goal(r):
    n, s, o, p = person(r)
    e = r.randint(3, 12) * 5
    weeks = r.randint(3, 15)
    have = r.randint(10, 120)
    cost = have + e * weeks
    job = r.choice(["mowing lawns", "walking dogs", "washing cars", "tutoring", "babysitting"])
    thing = r.choice(["laptop", "guitar", "tablet", "camera", "bicycle"])
    q = (f"{n} wants to buy a {thing} that costs ${fmt(r, cost)}. {cap(s)} already has ${have}. "
         f"{cap(s)} earns ${e} each week from {job}. How many weeks will {s} need to work "
         f"to have enough money for the {thing}?")
    w = Work()
    v1 = w.step(f"{cost}-{have}", f"{cap(s)} still needs @.", True)
    w.step(f"{v1}/{e}", f"{cap(s)} needs to work @ weeks.")
    return q, w


def t_discount(r):
    n, s, o, p = person(r)
    item = r.choice(["jacket", "pair of boots", "backpack", "lamp", "sweater", "watch"])
    pct = r.choice([10, 20, 25, 30, 40, 50])
    price = r.randint(2, 12) * 20
    k = r.randint(2, 4)
    q = (f"A {item} normally costs ${price}. During a sale, the store takes {pct}% off the price. "
         f"How much does {n} pay for {k} of them during the sale?")
    w = Work()
    v1 = w.step(f"{price}*{pct}/100", "The discount is @ per item.", True)
    v2 = w.step(f"{price}-{v1}", "The sale price is @.", True)
    w.step(f"{v2}*{k}", f"{n} pays @ in total.", True)
    return q, w


def t_tip_split(r):
    bill = r.randint(3, 15) * 20
    tip = r.choice([10, 15, 20, 25])
    total = bill * (100 + tip) // 100
    if bill * (100 + tip) % 100:
        raise Retry("tip")
    divisors = [d for d in range(2, 9) if total % d == 0]
    if not divisors:
        raise Retry("split")
    people = r.choice(divisors)
    meal = r.choice(["dinner", "lunch", "brunch"])
    q = (f"{people} friends go out for {meal}. The bill comes to ${bill}, and they leave a {tip}% tip. "
         f"If they split the total evenly, how much does each friend pay?")
    w = Work()
    v1 = w.step(f"{bill}*{tip}/100", "The tip is @.", True)
    v2 = w.step(f"{bill}+{v1}", "The total is @.", True)
    w.step(f"{v2}/{people}", "Each friend pays @.", True)
    return q, w


def t_school_clubs(r):
    total = r.randint(2, 12) * 15 * r.choice([1, 2, 4])
    place = r.choice(["school", "summer camp", "sports center"])
    q = (f"A {place} has {total} children. Two fifths of them play soccer, and one third of "
         f"the rest play basketball. The others do not play any sport. "
         f"How many children do not play any sport?")
    w = Work()
    v1 = w.step(f"{total}*2/5", "@ children play soccer.")
    v2 = w.step(f"{total}-{v1}", "That leaves @ children.")
    v3 = w.step(f"{v2}/3", "@ children play basketball.")
    w.step(f"{v2}-{v3}", "So @ children do not play any sport.")
    return q, w


def t_factory_machines(r):
    thing = r.choice(["bottles", "toys", "bolts", "cans", "boxes"])
    rate, m, h, d = r.randint(5, 30), r.randint(2, 6), r.randint(4, 10), r.randint(2, 6)
    q = (f"A machine makes {rate} {thing} per hour. A factory runs {m} of these machines for "
         f"{h} hours a day. How many {thing} does the factory make in {d} days?")
    w = Work()
    v1 = w.step(f"{rate}*{m}", f"The machines make @ {thing} per hour together.")
    v2 = w.step(f"{v1}*{h}", f"In one day they make @ {thing}.")
    w.step(f"{v2}*{d}", f"In {d} days they make @ {thing}.")
    return q, w


def t_painters_together(r):
    a, *_ = person(r)
    b, *_ = person(r, [a])
    r1, r2 = r.randint(2, 5), r.randint(2, 5)
    k = r.randint(2, 9)
    rooms = (r1 + r2) * k
    job = r.choice([("paints", "rooms"), ("builds", "fences"), ("cleans", "offices"),
                    ("repairs", "bicycles")])
    q = (f"{a} {job[0]} {r1} {job[1]} per day and {b} {job[0]} {r2} {job[1]} per day. "
         f"Working together, how many days will it take them to finish {rooms} {job[1]}?")
    w = Work()
    v1 = w.step(f"{r1}+{r2}", f"Together they finish @ {job[1]} per day.")
    w.step(f"{rooms}/{v1}", "It will take them @ days.")
    return q, w


def t_fence_cost(r):
    L, W, c = r.randint(8, 40), r.randint(5, 30), r.randint(3, 15)
    area = r.choice(["garden", "yard", "playground", "pasture"])
    q = (f"A rectangular {area} is {L} meters long and {W} meters wide. Fencing costs ${c} per meter. "
         f"How much will it cost to put a fence all the way around the {area}?")
    w = Work()
    v1 = w.step(f"2*({L}+{W})", "The perimeter is @ meters.")
    w.step(f"{v1}*{c}", "The fence will cost @.", True)
    return q, w


def t_tile_boxes(r):
    L, W = r.randint(6, 25), r.randint(6, 20)
    area = L * W
    boxes = [b for b in (5, 6, 8, 10, 12, 15, 20) if area % b == 0]
    if not boxes:
        raise Retry("tiles")
    b = r.choice(boxes)
    n, s, o, p = person(r)
    q = (f"{n} is tiling a floor that measures {L} feet by {W} feet. Each tile covers one "
         f"square foot, and tiles come in boxes of {b}. How many boxes of tiles does {s} need?")
    w = Work()
    t1, v1 = w.c(f"{L}*{W}")
    w.say(f"The floor has an area of {t1} square feet, so {s} needs {v1} tiles.")
    w.step(f"{v1}/{b}", f"{cap(s)} needs @ boxes.")
    return q, w


def t_shirt_inventory(r):
    item = r.choice(["shirts", "hats", "mugs", "umbrellas", "scarves"])
    start = r.randint(300, 2500)
    a, b = r.randint(40, start // 4), r.randint(30, start // 4)
    c = r.randint(100, 900)
    q = (f"A store has {fmt(r, start)} {item} in stock. It sells {a} {item} on Monday and {b} on "
         f"Tuesday. On Wednesday a shipment of {c} more {item} arrives. How many {item} does the "
         f"store have now?")
    w = Work()
    v1 = w.step(f"{start}-{a}", f"After Monday the store has @ {item}.")
    v2 = w.step(f"{v1}-{b}", f"After Tuesday it has @ {item}.")
    w.step(f"{v2}+{c}", f"After the shipment it has @ {item}.")
    return q, w


def t_warehouse_boxes(r):
    item = r.choice(["cans of soup", "light bulbs", "books", "jars of jam", "soap bars"])
    boxes, per = r.randint(20, 90), r.choice([12, 24, 36, 48, 50])
    total = boxes * per
    out = r.randint(total // 5, total * 4 // 5)
    q = (f"A warehouse has {boxes} boxes with {per} {item} in each box. A truck takes away "
         f"{fmt(r, out)} {item}. How many {item} are left in the warehouse?")
    w = Work()
    v1 = w.step(f"{boxes}*{per}", f"The warehouse starts with @ {item}.")
    w.step(f"{v1}-{out}", f"After the truck leaves, @ {item} are left.")
    return q, w


def t_practice_hours(r):
    n, s, o, p = person(r)
    act = r.choice(["piano", "violin", "basketball", "chess", "drawing"])
    m, e = r.choice([30, 40, 45, 60, 75, 90]), r.choice([30, 60, 90, 120, 150])
    if (5 * m + 2 * e) % 60:
        raise Retry("minutes")
    q = (f"{n} practices {act} for {m} minutes each weekday and for {e} minutes on each day of the "
         f"weekend. How many hours does {s} practice {act} in a week?")
    w = Work()
    v1 = w.step(f"5*{m}", f"On weekdays {s} practices @ minutes.")
    v2 = w.step(f"2*{e}", f"On the weekend {s} practices @ minutes.")
    v3 = w.step(f"{v1}+{v2}", "That is @ minutes in total.")
    w.step(f"{v3}/60", "This is @ hours.")
    return q, w


def t_movie_minutes(r):
    n, s, o, p = person(r)
    h, m, k = r.randint(1, 3), r.randint(5, 55), r.randint(2, 6)
    show = r.choice(["movie", "play", "concert recording", "documentary"])
    hrs = "hour" if h == 1 else "hours"
    q = (f"{n}'s favorite {show} is {h} {hrs} and {m} minutes long. {cap(s)} has watched it "
         f"{k} times. How many minutes has {s} spent watching it?")
    w = Work()
    v1 = w.step(f"{h}*60", f"{h} {hrs} is @ minutes.")
    v2 = w.step(f"{v1}+{m}", f"The {show} is @ minutes long.")
    w.step(f"{v2}*{k}", f"{cap(s)} has spent @ minutes watching it.")
    return q, w


def t_fuel_cost(r):
    n, s, o, p = person(r)
    mpg = r.choice([20, 25, 30, 35, 40])
    dist = mpg * r.randint(3, 30)
    price = r.randint(3, 5)
    q = (f"{n}'s car can drive {mpg} miles on one gallon of gas. {cap(s)} is planning a trip of "
         f"{fmt(r, dist)} miles, and gas costs ${price} per gallon. How much will {s} spend on gas?")
    w = Work()
    v1 = w.step(f"{dist}/{mpg}", f"{cap(s)} needs @ gallons of gas.")
    w.step(f"{v1}*{price}", "The gas will cost @.", True)
    return q, w


def t_cookie_bags(r):
    n, s, o, p = person(r)
    batches, per = r.randint(2, 9), r.choice([12, 18, 24, 30, 36])
    total = batches * per
    bags = [b for b in (3, 4, 5, 6, 8, 9, 10) if total % b == 0]
    k = r.choice(bags)
    treat = r.choice(["cookies", "brownies", "cinnamon rolls", "macarons"])
    q = (f"{n} bakes {batches} batches of {treat} with {per} {treat} in each batch. {cap(s)} packs "
         f"them into bags of {k}. How many bags can {s} fill?")
    w = Work()
    v1 = w.step(f"{batches}*{per}", f"{cap(s)} bakes @ {treat}.")
    w.step(f"{v1}/{k}", f"{cap(s)} can fill @ bags.")
    return q, w


def t_pizza_leftover(r):
    n, s, o, p = person(r)
    pizzas, slices = r.randint(2, 7), r.choice([6, 8, 10, 12])
    friends, each = r.randint(2, 6), r.randint(2, 4)
    if (friends + 1) * each >= pizzas * slices:
        raise Retry("pizza")
    q = (f"{n} orders {pizzas} pizzas for a party. Each pizza is cut into {slices} slices. "
         f"{cap(s)} and {p} {friends} friends each eat {each} slices. How many slices are left over?")
    w = Work()
    v1 = w.step(f"{pizzas}*{slices}", "There are @ slices in total.")
    v2 = w.step(f"{friends}+1", "There are @ people eating.")
    v3 = w.step(f"{v2}*{each}", "They eat @ slices.")
    w.step(f"{v1}-{v3}", "There are @ slices left over.")
    return q, w


def t_babysitting_half(r):
    n, s, o, p = person(r)
    rate, h, wk = r.randint(8, 20), r.randint(2, 6), r.randint(2, 8)
    if (rate * h * wk) % 2:
        raise Retry("half")
    job = r.choice(["babysitting", "tutoring", "dog walking", "working at a cafe"])
    q = (f"{n} earns ${rate} per hour {job}. {cap(s)} works {h} hours every weekend. After "
         f"{wk} weekends, {s} spends half of the money on clothes. How much money does {s} have left?")
    w = Work()
    v1 = w.step(f"{rate}*{h}", f"Each weekend {s} earns @.", True)
    v2 = w.step(f"{v1}*{wk}", f"After {wk} weekends {s} has @.", True)
    w.step(f"{v2}/2", f"After spending half, {s} has @ left.", True)
    return q, w


def t_overtime(r):
    n, s, o, p = person(r)
    rate = r.randint(6, 15) * 2
    hours = r.randint(42, 55)
    q = (f"{n} earns ${rate} an hour for the first 40 hours {s} works each week and 1.5 times "
         f"that rate for every hour after that. How much does {s} earn in a week when {s} works "
         f"{hours} hours?")
    w = Work()
    v1 = w.step(f"40*{rate}", f"For the first 40 hours {s} earns @.", True)
    v2 = w.step(f"{hours}-40", f"{cap(s)} works @ hours of overtime.")
    v3 = w.step(f"{rate}*1.5", "The overtime rate is @ per hour.", True)
    v4 = w.step(f"{v2}*{v3}", "Overtime pays @.", True)
    w.step(f"{v1}+{v4}", f"In total {s} earns @.", True)
    return q, w


def t_population_growth(r):
    pct = r.choice([5, 10, 12, 15, 20, 25])
    pop = r.randint(4, 90) * 100
    if pop * pct % 100:
        raise Retry("pop")
    town = r.choice(["Millbrook", "Cedar Falls", "Riverton", "Oakdale", "Pine Hollow"])
    q = (f"The town of {town} had {fmt(r, pop)} residents last year. This year the population grew "
         f"by {pct}%. How many residents does {town} have now?")
    w = Work()
    v1 = w.step(f"{pop}*{pct}/100", "The population grew by @ people.")
    w.step(f"{pop}+{v1}", f"{town} now has @ residents.")
    return q, w


def t_test_needed(r):
    n, s, o, p = person(r)
    goal = r.randint(75, 92)
    scores = [r.randint(65, 100) for _ in range(3)]
    need = goal * 4 - sum(scores)
    if not 50 <= need <= 100:
        raise Retry("score")
    q = (f"{n} scored {scores[0]}, {scores[1]}, and {scores[2]} on {p} first three math tests. "
         f"What score does {s} need on the fourth test to have an average of {goal}?")
    w = Work()
    v1 = w.step(f"{goal}*4", f"To average {goal}, {s} needs @ points in total.")
    v2 = w.step(f"{scores[0]}+{scores[1]}+{scores[2]}", f"So far {s} has @ points.")
    w.step(f"{v1}-{v2}", f"{cap(s)} needs a score of @ on the fourth test.")
    return q, w


def t_average_run(r):
    n, s, o, p = person(r)
    avg = r.randint(3, 9)
    days = [r.randint(2, 12) for _ in range(3)]
    last = avg * 4 - sum(days)
    if last < 2:
        raise Retry("avg")
    days.append(last)
    unit = r.choice(["miles", "kilometers"])
    q = (f"{n} runs {days[0]} {unit} on Monday, {days[1]} on Tuesday, {days[2]} on Wednesday, and "
         f"{days[3]} on Thursday. What is the average distance {s} runs per day?")
    w = Work()
    v1 = w.step("+".join(str(d) for d in days), f"{cap(s)} runs @ {unit} in total.")
    w.step(f"{v1}/4", f"The average is @ {unit} per day.")
    return q, w


def t_fruit_basket(r):
    total = 12 * r.randint(2, 15)
    q = (f"A fruit stand has {total} pieces of fruit. One quarter of them are apples, one third are "
         f"oranges, and the rest are bananas. How many bananas are there?")
    w = Work()
    v1 = w.step(f"{total}/4", "There are @ apples.")
    v2 = w.step(f"{total}/3", "There are @ oranges.")
    v3 = w.step(f"{v1}+{v2}", "Apples and oranges make @ pieces of fruit.")
    w.step(f"{total}-{v3}", "There are @ bananas.")
    return q, w


def t_theater_tickets(r):
    adult, child = r.randint(8, 20), r.randint(3, 7)
    na, nc = r.randint(50, 400), r.randint(40, 300)
    venue = r.choice(["theater", "museum", "zoo", "aquarium"])
    q = (f"Adult tickets to the {venue} cost ${adult} and child tickets cost ${child}. On Saturday "
         f"the {venue} sold {na} adult tickets and {nc} child tickets. How much money did the "
         f"{venue} make on Saturday?")
    w = Work()
    v1 = w.step(f"{na}*{adult}", "Adult tickets brought in @.", True)
    v2 = w.step(f"{nc}*{child}", "Child tickets brought in @.", True)
    w.step(f"{v1}+{v2}", f"The {venue} made @ on Saturday.", True)
    return q, w


def t_tomato_rows(r):
    n, s, o, p = person(r)
    rows, per, each = r.randint(3, 10), r.randint(4, 12), r.randint(5, 20)
    crop = r.choice([("tomato plants", "tomatoes"), ("pepper plants", "peppers"),
                     ("strawberry plants", "strawberries"), ("bean plants", "beans")])
    q = (f"{n} plants {rows} rows of {crop[0]} with {per} plants in each row. Each plant produces "
         f"{each} {crop[1]}. How many {crop[1]} does {s} harvest?")
    w = Work()
    v1 = w.step(f"{rows}*{per}", f"{cap(s)} has @ plants.")
    w.step(f"{v1}*{each}", f"{cap(s)} harvests @ {crop[1]}.")
    return q, w


def t_stamp_share(r):
    n, s, o, p = person(r)
    start, m, k = r.randint(20, 200), r.randint(5, 30), r.randint(2, 12)
    x = r.choice([2, 3, 4, 5])
    total = start + m * k
    if total % x:
        raise Retry("stamps")
    rel = r.choice(RELATIVES_F if r.random() < 0.5 else RELATIVES_M)
    frac = {2: "half", 3: "one third", 4: "one quarter", 5: "one fifth"}[x]
    thing = r.choice(["stamps", "stickers", "coins", "trading cards"])
    q = (f"{n} has {start} {thing}. Every month {s} adds {m} more to {p} collection. After {k} "
         f"months, {s} gives {frac} of {p} {thing} to {p} {rel}. How many {thing} does {n} have left?")
    w = Work()
    v1 = w.step(f"{m}*{k}", f"{cap(s)} adds @ {thing}.")
    v2 = w.step(f"{start}+{v1}", f"{cap(s)} then has @ {thing}.")
    v3 = w.step(f"{v2}/{x}", f"{cap(s)} gives away @ {thing}.")
    w.step(f"{v2}-{v3}", f"{cap(s)} has @ {thing} left.")
    return q, w


def t_square_area(r):
    side = r.randint(3, 40)
    per = side * 4
    thing = r.choice(["square garden", "square rug", "square field", "square patio"])
    unit = r.choice(["feet", "meters", "yards"])
    q = (f"A {thing} has a perimeter of {per} {unit}. What is its area in square {unit}?")
    w = Work()
    v1 = w.step(f"{per}/4", f"Each side is @ {unit} long.")
    w.step(f"{v1}*{v1}", f"The area is @ square {unit}.")
    return q, w


def t_poster_cutout(r):
    L, W = r.randint(20, 60), r.randint(15, 50)
    side = r.randint(3, min(L, W) - 2)
    q = (f"A rectangular piece of cardboard is {L} cm long and {W} cm wide. A square hole with "
         f"sides of {side} cm is cut out of it. What is the area of the cardboard that is left, "
         f"in square centimeters?")
    w = Work()
    v1 = w.step(f"{L}*{W}", "The whole piece has an area of @ square cm.")
    v2 = w.step(f"{side}*{side}", "The hole has an area of @ square cm.")
    w.step(f"{v1}-{v2}", "The remaining area is @ square cm.")
    return q, w


def t_cyclist_rate(r):
    n, s, o, p = person(r)
    speed, h, h2 = r.randint(8, 25), r.randint(2, 5), r.randint(3, 9)
    if h2 == h:
        raise Retry("same")
    dist = speed * h
    mode = r.choice(["rides a bike", "rows a boat", "skates", "jogs"])
    q = (f"{n} {mode} {dist} kilometers in {h} hours. At the same speed, how many kilometers can "
         f"{s} cover in {h2} hours?")
    w = Work()
    v1 = w.step(f"{dist}/{h}", f"{cap(s)} covers @ kilometers per hour.")
    w.step(f"{v1}*{h2}", f"In {h2} hours {s} covers @ kilometers.")
    return q, w


def t_opposite_cars(r):
    a, b, h = r.randint(30, 70), r.randint(30, 70), r.randint(2, 6)
    q = (f"Two cars leave the same gas station at the same time and drive in opposite directions. "
         f"One drives at {a} miles per hour and the other at {b} miles per hour. How far apart are "
         f"they after {h} hours?")
    w = Work()
    v1 = w.step(f"{a}*{h}", "The first car drives @ miles.")
    v2 = w.step(f"{b}*{h}", "The second car drives @ miles.")
    w.step(f"{v1}+{v2}", "They are @ miles apart.")
    return q, w


def t_homework_minutes(r):
    n, s, o, p = person(r)
    math, read = r.randint(15, 50), r.randint(10, 40)
    k = r.choice([2, 3])
    times = {2: "twice", 3: "three times"}[k]
    q = (f"{n} spends {math} minutes on math homework and {read} minutes on reading. {cap(s)} "
         f"spends {times} as long on science as on math. How many minutes does {s} spend on "
         f"homework in total?")
    w = Work()
    v1 = w.step(f"{math}*{k}", f"{cap(s)} spends @ minutes on science.")
    w.step(f"{math}+{read}+{v1}", f"In total {s} spends @ minutes on homework.")
    return q, w


def t_sleep_week(r):
    n, s, o, p = person(r)
    h, extra = r.randint(6, 9), r.randint(2, 3)
    q = (f"{n} sleeps {h} hours each night from Monday to Friday. On Saturday and Sunday {s} sleeps "
         f"{extra} hours more each night. How many hours does {s} sleep in a week?")
    w = Work()
    v1 = w.step(f"5*{h}", f"On weeknights {s} sleeps @ hours.")
    v2 = w.step(f"{h}+{extra}", f"On weekend nights {s} sleeps @ hours each.")
    v3 = w.step(f"2*{v2}", f"Over the weekend {s} sleeps @ hours.")
    w.step(f"{v1}+{v3}", f"In a week {s} sleeps @ hours.")
    return q, w


def t_tank_fill(r):
    rate, mins = r.randint(5, 40), r.randint(5, 60)
    start = r.randint(20, 400)
    cap_l = start + rate * mins
    tank = r.choice(["water tank", "swimming pool", "fish tank", "rain barrel"])
    q = (f"A {tank} holds {fmt(r, cap_l)} liters. It already has {start} liters in it. A hose adds "
         f"{rate} liters every minute. How many minutes will it take to fill the {tank}?")
    w = Work()
    v1 = w.step(f"{cap_l}-{start}", f"The {tank} needs @ more liters.")
    w.step(f"{v1}/{rate}", "It will take @ minutes.")
    return q, w


def t_bus_seats(r):
    cap_s = r.choice([40, 45, 50, 55, 60])
    a = r.randint(15, 35)
    off, on = r.randint(3, a - 5), r.randint(5, 25)
    if a - off + on >= cap_s:
        raise Retry("bus")
    q = (f"A bus has {cap_s} seats. At the first stop {a} passengers get on. At the second stop "
         f"{off} passengers get off and {on} passengers get on. If every passenger takes a seat, "
         f"how many seats are empty now?")
    w = Work()
    v1 = w.step(f"{a}-{off}", "After people get off there are @ passengers.")
    v2 = w.step(f"{v1}+{on}", "After new passengers get on there are @ passengers.")
    w.step(f"{cap_s}-{v2}", "There are @ empty seats.")
    return q, w


def t_library_mysteries(r):
    books = 24 * r.randint(10, 250)
    q = (f"A library has {fmt(r, books)} books. Three eighths of the books are fiction, and one "
         f"third of the fiction books are mysteries. How many mystery books does the library have?")
    w = Work()
    v1 = w.step(f"{books}*3/8", "The library has @ fiction books.")
    w.step(f"{v1}/3", "It has @ mystery books.")
    return q, w


def t_coin_jar(r):
    n, s, o, p = person(r)
    qn, d, nk = r.randint(3, 30), r.randint(2, 25), r.randint(2, 20)
    q = (f"{n} has {qn} quarters, {d} dimes, and {nk} nickels in {p} piggy bank. How many cents "
         f"does {s} have in total?")
    w = Work()
    v1 = w.step(f"{qn}*25", "The quarters are worth @ cents.")
    v2 = w.step(f"{d}*10", "The dimes are worth @ cents.")
    v3 = w.step(f"{nk}*5", "The nickels are worth @ cents.")
    w.step(f"{v1}+{v2}+{v3}", f"{cap(s)} has @ cents in total.")
    return q, w


def t_farm_legs(r):
    n, s, o, p = person(r)
    birds, beasts = r.randint(5, 40), r.randint(3, 25)
    bird = r.choice(["chickens", "ducks", "geese", "turkeys"])
    beast = r.choice(["cows", "goats", "sheep", "pigs", "horses"])
    q = (f"{n}'s farm has {birds} {bird} and {beasts} {beast}. How many legs do the animals on the "
         f"farm have altogether?")
    w = Work()
    v1 = w.step(f"{birds}*2", f"The {bird} have @ legs.")
    v2 = w.step(f"{beasts}*4", f"The {beast} have @ legs.")
    w.step(f"{v1}+{v2}", "Altogether the animals have @ legs.")
    return q, w


def t_pack_price(r):
    n, s, o, p = person(r)
    k = r.choice([4, 5, 6, 8, 10, 12])
    price = r.randint(2, 9)
    need = k * r.randint(3, 15)
    item = r.choice(["pencils", "batteries", "yogurt cups", "tennis balls", "candles"])
    q = (f"A pack of {k} {item} costs ${price}. {n} needs {need} {item} for a school event. "
         f"How much will {s} spend on {item}?")
    w = Work()
    v1 = w.step(f"{need}/{k}", f"{cap(s)} needs @ packs.")
    w.step(f"{v1}*{price}", f"{cap(s)} will spend @.", True)
    return q, w


def t_gym_year(r):
    n, s, o, p = person(r)
    fee, month = r.randint(2, 10) * 10, r.randint(15, 60)
    rel = r.choice(RELATIVES_F if r.random() < 0.5 else RELATIVES_M)
    q = (f"A gym charges a one-time sign-up fee of ${fee} and ${month} per month. {n} and {p} "
         f"{rel} both join the gym. How much do they pay together for the first year?")
    w = Work()
    v1 = w.step(f"{month}*12", "Twelve months cost @ for one person.", True)
    v2 = w.step(f"{v1}+{fee}", "With the sign-up fee, one person pays @.", True)
    w.step(f"{v2}*2", "Together they pay @.", True)
    return q, w


def t_marble_share(r):
    a, *_ = person(r)
    b, *_ = person(r, [a])
    x, k = r.randint(5, 40), r.randint(2, 5)
    friends = r.choice([2, 3, 4, 5, 6])
    total = x + x * k
    if total % friends:
        raise Retry("share")
    thing = r.choice(["marbles", "seashells", "beads", "crayons"])
    q = (f"{a} has {x} {thing}. {b} has {k} times as many {thing} as {a}. They put all their "
         f"{thing} together and share them equally among {friends} friends. How many {thing} "
         f"does each friend get?")
    w = Work()
    v1 = w.step(f"{x}*{k}", f"{b} has @ {thing}.")
    v2 = w.step(f"{x}+{v1}", f"Together they have @ {thing}.")
    w.step(f"{v2}/{friends}", f"Each friend gets @ {thing}.")
    return q, w


def t_lemonade_profit(r):
    n, s, o, p = person(r)
    price, cups = r.randint(2, 5), r.randint(20, 120)
    cost = r.randint(8, 40)
    if price * cups <= cost:
        raise Retry("profit")
    stand = r.choice(["lemonade", "iced tea", "hot cocoa", "fruit punch"])
    article = "an" if stand[0] in "aeiou" else "a"
    q = (f"{n} runs {article} {stand} stand. {cap(s)} spends ${cost} on supplies and sells each cup for "
         f"${price}. If {s} sells {cups} cups, how much profit does {s} make?")
    w = Work()
    v1 = w.step(f"{cups}*{price}", f"{cap(s)} earns @ from sales.", True)
    w.step(f"{v1}-{cost}", f"{cap(s)} makes a profit of @.", True)
    return q, w


def t_rainfall(r):
    a, less = r.randint(4, 30), r.randint(2, 8)
    town = r.choice(["Springfield", "Lakeside", "Hillview", "Brookport"])
    q = (f"In {town} it rained {a} millimeters on Monday. On Tuesday it rained twice as much as on "
         f"Monday, and on Wednesday it rained {less} millimeters less than on Tuesday. How many "
         f"millimeters of rain fell over the three days?")
    w = Work()
    v1 = w.step(f"{a}*2", "On Tuesday it rained @ millimeters.")
    v2 = w.step(f"{v1}-{less}", "On Wednesday it rained @ millimeters.")
    w.step(f"{a}+{v1}+{v2}", "In total @ millimeters of rain fell.")
    return q, w


def t_paint_cans(r):
    n, s, o, p = person(r)
    L, H = r.randint(8, 30), r.randint(8, 12)
    walls = r.choice([2, 3, 4])
    cover = r.choice([20, 25, 40, 50, 60, 80, 100])
    area = L * H * walls
    if area % cover:
        raise Retry("paint")
    q = (f"{n} wants to paint {walls} walls. Each wall is {L} feet wide and {H} feet tall. One can "
         f"of paint covers {cover} square feet. How many cans of paint does {s} need?")
    w = Work()
    v1 = w.step(f"{L}*{H}", "Each wall has an area of @ square feet.")
    v2 = w.step(f"{v1}*{walls}", "All the walls have an area of @ square feet.")
    w.step(f"{v2}/{cover}", f"{cap(s)} needs @ cans of paint.")
    return q, w


def t_defective_toys(r):
    made = r.randint(10, 90) * 100
    pct = r.choice([2, 3, 4, 5, 6, 8, 10])
    thing = r.choice(["toys", "phone cases", "light bulbs", "water bottles"])
    q = (f"A factory made {fmt(r, made)} {thing} last week. {pct}% of them were defective and had "
         f"to be thrown away. How many {thing} were not defective?")
    w = Work()
    v1 = w.step(f"{made}*{pct}/100", f"@ {thing} were defective.")
    w.step(f"{made}-{v1}", f"@ {thing} were not defective.")
    return q, w


def t_commission(r):
    n, s, o, p = person(r)
    base = r.randint(10, 30) * 100
    pct = r.choice([2, 4, 5, 10])
    sales = r.randint(10, 80) * 500
    q = (f"{n} is a salesperson who earns a base salary of ${fmt(r, base)} per month plus a {pct}% "
         f"commission on {p} sales. Last month {s} sold ${fmt(r, sales)} worth of furniture. How much "
         f"did {s} earn last month?")
    w = Work()
    v1 = w.step(f"{sales}*{pct}/100", f"{cap(p)} commission was @.", True)
    w.step(f"{base}+{v1}", f"{cap(s)} earned @ in total.", True)
    return q, w


def t_rent_split(r):
    rent = r.randint(12, 40) * 100
    util = r.randint(6, 30) * 10
    people = r.choice([2, 3, 4, 5])
    total = rent + util
    if total % people:
        raise Retry("rent")
    q = (f"{people} roommates share an apartment. The rent is ${fmt(r, rent)} per month and the "
         f"utilities are ${util} per month. If they split everything equally, how much does each "
         f"roommate pay per month?")
    w = Work()
    v1 = w.step(f"{rent}+{util}", "The total monthly cost is @.", True)
    w.step(f"{v1}/{people}", "Each roommate pays @.", True)
    return q, w


def t_egg_cartons(r):
    n, s, o, p = person(r)
    hens, eggs, weeks = r.randint(6, 30), r.randint(3, 7), r.randint(2, 4)
    total = hens * eggs * weeks
    if total % 12:
        raise Retry("eggs")
    price = r.randint(3, 6)
    q = (f"{n} has {hens} hens, and each hen lays {eggs} eggs a week. After {weeks} weeks {s} "
         f"packs all the eggs into cartons of a dozen and sells each carton for ${price}. "
         f"How much money does {s} make?")
    w = Work()
    v1 = w.step(f"{hens}*{eggs}", "The hens lay @ eggs a week.")
    v2 = w.step(f"{v1}*{weeks}", f"In {weeks} weeks they lay @ eggs.")
    v3 = w.step(f"{v2}/12", "That fills @ cartons.")
    w.step(f"{v3}*{price}", f"{cap(s)} makes @.", True)
    return q, w


def t_steps_walk(r):
    n, s, o, p = person(r)
    steps, days = r.randint(30, 120) * 100, r.randint(3, 7)
    goal = steps * days + r.randint(5, 60) * 100
    q = (f"{n} walks {fmt(r, steps)} steps every day. {cap(p)} goal for the week is "
         f"{fmt(r, goal)} steps. After {days} days, how many more steps does {s} need to reach "
         f"{p} goal?")
    w = Work()
    v1 = w.step(f"{steps}*{days}", f"After {days} days {s} has walked @ steps.")
    w.step(f"{goal}-{v1}", f"{cap(s)} needs @ more steps.")
    return q, w


def t_concert_chairs(r):
    rows, per = r.randint(10, 40), r.randint(12, 30)
    sold = r.randint(rows * per // 3, rows * per - 10)
    q = (f"A concert hall has {rows} rows of seats with {per} seats in each row. {fmt(r, sold)} "
         f"tickets have been sold so far. How many seats are still available?")
    w = Work()
    v1 = w.step(f"{rows}*{per}", "The hall has @ seats.")
    w.step(f"{v1}-{sold}", "@ seats are still available.")
    return q, w


def t_phone_plan(r):
    n, s, o, p = person(r)
    base, incl = r.randint(20, 50), r.randint(2, 10)
    extra = r.randint(3, 10)
    used = incl + r.randint(1, 8)
    months = r.randint(2, 6)
    q = (f"{n}'s phone plan costs ${base} per month and includes {incl} GB of data. Each extra GB "
         f"costs ${extra}. If {s} uses {used} GB every month, how much does {s} pay over {months} "
         f"months?")
    w = Work()
    v1 = w.step(f"{used}-{incl}", f"{cap(s)} uses @ extra GB each month.")
    v2 = w.step(f"{v1}*{extra}", "The extra data costs @ per month.", True)
    v3 = w.step(f"{base}+{v2}", f"Each month {s} pays @.", True)
    w.step(f"{v3}*{months}", f"Over {months} months {s} pays @.", True)
    return q, w


def t_aquarium_fish(r):
    n, s, o, p = person(r)
    tanks, fish = r.randint(2, 8), r.randint(4, 15)
    bought, died = r.randint(3, 20), r.randint(2, 6)
    q = (f"{n} has {tanks} fish tanks with {fish} fish in each tank. {cap(s)} buys {bought} more "
         f"fish and then gives {died} fish to a friend. How many fish does {n} have now?")
    w = Work()
    v1 = w.step(f"{tanks}*{fish}", f"{cap(s)} starts with @ fish.")
    v2 = w.step(f"{v1}+{bought}", f"After buying more, {s} has @ fish.")
    w.step(f"{v2}-{died}", f"{cap(s)} now has @ fish.")
    return q, w


TEMPLATES: List[Template] = [
    t_school_supplies, t_ages_family, t_ages_future, t_train_two_legs, t_reading_days,
    t_recipe_scale, t_weekly_savings, t_savings_goal, t_discount, t_tip_split,
    t_school_clubs, t_factory_machines, t_painters_together, t_fence_cost, t_tile_boxes,
    t_shirt_inventory, t_warehouse_boxes, t_practice_hours, t_movie_minutes, t_fuel_cost,
    t_cookie_bags, t_pizza_leftover, t_babysitting_half, t_overtime, t_population_growth,
    t_test_needed, t_average_run, t_fruit_basket, t_theater_tickets, t_tomato_rows,
    t_stamp_share, t_square_area, t_poster_cutout, t_cyclist_rate, t_opposite_cars,
    t_homework_minutes, t_sleep_week, t_tank_fill, t_bus_seats, t_library_mysteries,
    t_coin_jar, t_farm_legs, t_pack_price, t_gym_year, t_marble_share,
    t_lemonade_profit, t_rainfall, t_paint_cans, t_defective_toys, t_commission,
    t_rent_split, t_egg_cartons, t_steps_walk, t_concert_chairs, t_phone_plan,
    t_aquarium_fish,
]


# --------------------------------------------------------------------------
# building the splits
# --------------------------------------------------------------------------


def make_row(template: Template, rng: random.Random) -> Dict[str, str]:
    """Draw one problem from ``template``, retrying until the numbers work out."""
    for _ in range(MAX_TRIES):
        try:
            question, work = template(rng)
        except Retry:
            continue
        if work.last is None or not 2 <= len(work.lines) <= 5:
            raise AssertionError(f"{template.__name__}: bad number of steps")
        answer = "\n".join(work.lines + [f"#### {work.last}"])
        return {"question": question, "answer": answer}
    raise RuntimeError(f"{template.__name__}: could not draw valid numbers")


def build_splits(seed: int = SEED) -> Tuple[List[Dict[str, str]], List[Dict[str, str]]]:
    """Return (train_rows, test_rows); no question is repeated within or across splits."""
    rng = random.Random(seed)
    seen = set()

    def draw(count: int) -> List[Dict[str, str]]:
        rows = []
        for i in range(count):
            template = TEMPLATES[i % len(TEMPLATES)]
            for _ in range(MAX_TRIES):
                row = make_row(template, rng)
                if row["question"] not in seen:
                    break
            else:
                raise RuntimeError(f"{template.__name__}: too many duplicate questions")
            seen.add(row["question"])
            rows.append(row)
        rng.shuffle(rows)
        return rows

    train = draw(N_TRAIN)
    test = draw(N_TEST)
    return train, test


def _write_jsonl(path: Path, rows: List[Dict[str, str]]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        for row in rows:
            fh.write(json.dumps({"question": row["question"], "answer": row["answer"]},
                                ensure_ascii=False) + "\n")


def write_splits(out_dir: Path | str = DEFAULT_OUT_DIR, seed: int = SEED) -> Tuple[Path, Path]:
    """Build both splits and write ``train.jsonl`` and ``test.jsonl`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, test = build_splits(seed)
    train_path, test_path = out / TRAIN_FILE, out / TEST_FILE
    _write_jsonl(train_path, train)
    _write_jsonl(test_path, test)
    return train_path, test_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR,
                        help="directory to write train.jsonl and test.jsonl into")
    args = parser.parse_args(argv)
    train_path, test_path = write_splits(args.out_dir)
    print(f"wrote {N_TRAIN} rows to {train_path}")
    print(f"wrote {N_TEST} rows to {test_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
