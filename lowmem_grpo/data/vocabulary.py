"""The vocabulary of the generated word problems (docs/data.md, "Wording: frames and phrasings"): FRAMES, the
PHRASINGS of each operation, and the held-out ones. A phrasing is told in every frame whose item it fits.

Template words: `{Sub}` the holder as a subject (name or pronoun), `{Name}`/`{name}` its name, `{he} {him} {his}
{His}` its pronouns, `{Other}` a person a comparison introduces, `{rel}` a relative, `{receiver(s)}` who shares go
to, and the item's words (`Item.words`). Numbers: `{a}` a start, `{b}` an amount, `{g}` `{k}` (g containers of k, a
multiplier, a divisor), `{p}` a price, `{d}` a distractor; bare or as `{b:q}` "4 marbles" / "$4", `{b:more}` "4 more
marbles", `{b:fewer}` "4 fewer marbles" / "$4 less", `{b:of}` "4 of the marbles", `{p:$}` "$4". Solution lines add
`{calc}`, the annotated computation in the result's unit.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass, field

NUMBER_FIELDS = frozenset("abgkpd")  # template fields that are numbers (the rest are words)
_FORMATTER = string.Formatter()


@dataclass(frozen=True)
class Item:
    """What is counted: its nouns for one and several ("meter of ribbon", "meters of ribbon"), the verbs it takes
    (`tags`, a phrasing's `needs`), the (one, many, preposition) of the container it is kept in (None: no container
    phrasings), the whole of it after "the" (`stuff`, empty: `many`), a measured item's unit (one, many) and whether
    it is dollars (written "$4")."""

    one: str
    many: str
    tags: frozenset[str]
    container: tuple[str, str, str] | None = None
    stuff: str = ""
    unit: tuple[str, str] | None = None
    money: bool = False

    @property
    def whole(self) -> str:
        return self.stuff or self.many

    def noun(self, n: int) -> str:
        return self.one if n == 1 else self.many

    def amount(self, n: int, spec: str = "") -> str:
        shown = f"{n:,}"
        if spec == "":
            return shown
        if spec == "$" or (self.money and spec == "q"):
            return f"${shown}"
        if self.money:
            return {"more": f"${shown} more", "fewer": f"${shown} less", "of": f"${shown} of the money"}[spec]
        if spec == "of":
            return f"{shown} {self.unit[n != 1]} of the {self.whole}" if self.unit else f"{shown} of the {self.whole}"
        return {"q": f"{shown} {self.noun(n)}", "more": f"{shown} more {self.noun(n)}",
                "fewer": f"{shown} fewer {self.noun(n)}"}[spec]

    def words(self) -> dict[str, str]:
        mass = self.money or self.unit is not None
        one, many, prep = self.container or ("", "", "")
        return {"item": self.one, "items": self.many, "stuff": self.whole, "stuff_are": "is" if mass else "are",
                "are": "is" if self.money else "are",
                "how_many": "How much money" if self.money else f"How many {self.many}",
                "as_many": "as much money" if self.money else f"as many {self.many}",
                "per": self.unit[0] if self.unit else self.one,
                "same": f"the same amount of {self.whole}" if mass else f"the same number of {self.many}",
                "container": one, "containers": many, "prep": prep,
                "group": "part" if mass else "group", "groups": "parts" if mass else "groups"}


MONEY = Item("dollar", "dollars", frozenset({"earn", "save", "spend", "lose", "give", "find", "share"}),
             ("envelope", "envelopes", "in"), stuff="money", money=True)
"""Dollars: the savings frame's item, and what a sale turns any item into."""


@dataclass(frozen=True)
class Frame:
    """Who holds the quantity, what it is, where: its name, the items one is drawn from per problem (no two frames
    share a noun), the openings stating the start {a}, a thing holding the quantity ("the bus"; None: a person drawn
    per problem), the question about the running quantity, distractor sentences with a {d} the solution never uses,
    and whether it reads naturally with hundreds or thousands."""

    key: str
    items: tuple[Item, ...]
    openings: tuple[str, ...]
    holder: str | None = None
    ask: str = "{how_many} does {name} have now?"
    distract: tuple[str, ...] = ()
    big: bool = True


@dataclass(frozen=True)
class Phrasing:
    """One way of saying one operation (+ - * /): its key ("add.finds"), the number it draws (amount {b}, groups {g}
    of {k} as the problem's first quantity, times {k}, price {p} or divisor {k}), its question sentences (one drawn
    per use), its solution line ({calc}), the tags the frame and item must have, its question when last (None: the
    frame's), whether it may only stand last, and what it changes: "other" (a new person holds the result), "money"
    (the result is dollars) or "container" (the result counts containers)."""

    key: str
    op: str
    draw: str
    says: tuple[str, ...]
    line: str
    needs: frozenset[str] = field(default_factory=frozenset)
    ask: str | None = None
    last: bool = False
    effect: str = ""

    @property
    def start(self) -> bool:
        return self.draw == "groups"


def _p(key: str, op: str, draw: str, says: str | tuple[str, ...], line: str, needs: str = "", **kw: object
       ) -> Phrasing:
    return Phrasing(key, op, draw, (says,) if isinstance(says, str) else says, line, frozenset(needs.split()),
                    **kw)  # type: ignore[arg-type]


_NOW, _OTHER_ASK = "{Sub} now has {calc}.", "{how_many} does {name} have?"

PHRASINGS: tuple[Phrasing, ...] = (
    _p("add.finds", "+", "amount", "{Sub} finds {b:more}.", _NOW, "person find"),
    _p("add.is_given", "+", "amount", "{Sub} is given {b:more}.", _NOW, "person give"),
    _p("add.gift", "+", "amount", "{His} {rel} gives {him} {b:more}.", _NOW, "person give"),
    _p("add.buys", "+", "amount", "{Sub} buys {b:more}.", _NOW, "person buy"),
    _p("add.earns", "+", "amount", "{Sub} earns {b:more}.", _NOW, "person earn"),
    _p("add.picks", "+", "amount", "{Sub} picks {b:more}.", _NOW, "person pick"),
    _p("add.wins", "+", "amount", "{Sub} wins {b:more} in a game.", _NOW, "person win"),
    _p("add.makes", "+", "amount", "{Sub} makes {b:more}.", _NOW, "person make"),
    _p("add.collects", "+", "amount", "{Sub} collects {b:more}.", _NOW, "person collect"),
    _p("add.saves", "+", "amount", "{Sub} saves {b:more}.", _NOW, "person save"),
    _p("add.more_than", "+", "amount", "{Other} has {b:more} than {name}.", "{Name} has {calc}.", "person",
       ask=_OTHER_ASK, effect="other"),
    _p("add.get_on", "+", "amount", ("At the next stop, {b:more} get on.", "Then {b:more} get on."), _NOW, "ride"),
    _p("sub.loses", "-", "amount", "{Sub} loses {b:q}.", _NOW, "person lose"),
    _p("sub.spends", "-", "amount", "{Sub} spends {b:q}.", _NOW, "person spend"),
    _p("sub.gives_away", "-", "amount", "{Sub} gives away {b:q}.", _NOW, "person give"),
    _p("sub.gives_to", "-", "amount", "{Sub} gives {b:q} to {his} {rel}.", _NOW, "person give"),
    _p("sub.eats", "-", "amount", "{Sub} eats {b:of}.", _NOW, "person eat"),
    _p("sub.sells", "-", "amount", "{Sub} sells {b:of}.", _NOW, "person sell"),
    _p("sub.uses", "-", "amount", "{Sub} uses {b:of}.", _NOW, "person use"),
    _p("sub.fewer_than", "-", "amount", "{Other} has {b:fewer} than {name}.", "{Name} has {calc}.", "person",
       ask=_OTHER_ASK, effect="other"),
    _p("sub.get_off", "-", "amount", ("At the next stop, {b:q} get off.", "Then {b:q} get off."), _NOW, "ride"),
    _p("mul.each", "*", "groups", "{Name} has {g} {containers} with {k:q} {prep} each.", "{Sub} has {calc}.",
       "person container"),
    _p("mul.per", "*", "groups", "{Name} fills {g} {containers} with {k:q} per {container}.", "{Sub} has {calc}.",
       "person container"),
    _p("mul.every", "*", "groups", "Every one of {Name}'s {g} {containers} holds {k:q}.", "{Sub} has {calc}.",
       "person container"),
    _p("mul.rows_of", "*", "groups", "{Name} sets out {g} rows of {k:q}.", "{Sub} has {calc}.", "person arrange"),
    _p("mul.times_as_many", "*", "times", "{Other} has {k} times {as_many} as {name}.", "{Name} has {calc}.",
       "person", ask=_OTHER_ASK, effect="other"),
    _p("mul.sells_each", "*", "price", "{Sub} sells each {item} for {p:$}.", "{Sub} makes {calc}.", "person sell",
       ask="How much money does {name} make?", effect="money"),
    _p("mul.per_price", "*", "price", "{Sub} sells all of the {stuff} at {p:$} per {per}.", "{Sub} makes {calc}.",
       "person sell", ask="How much money does {name} make?", effect="money"),
    _p("div.equally", "/", "divisor", "{Sub} shares the {stuff} equally among {k} {receivers}.",
       "Each {receiver} gets {calc}.", "person share", ask="{how_many} does each {receiver} get?", last=True),
    _p("div.split", "/", "divisor", "The {stuff} {stuff_are} split into {k} equal {groups}.",
       "Each {group} has {calc}.", "share", ask="{how_many} {are} in each {group}?", last=True),
    _p("div.each_gets", "/", "divisor",
       "{Sub} gives all of the {stuff} to {k} {receivers}, and each {receiver} gets an equal share.",
       "Each {receiver} gets {calc}.", "person share", ask="{how_many} does each {receiver} get?", last=True),
    _p("div.per", "/", "divisor", "{Sub} packs the {stuff} into {containers}, {k:q} per {container}.",
       "{Sub} fills {calc}.", "person container", ask="{how_many} does {name} fill?", last=True,
       effect="container"),
    _p("div.same_each", "/", "divisor", "{Sub} puts {same} into each of {k} {containers}.",
       "Each {container} holds {calc}.", "person container", ask="{how_many} {are} in each {container}?", last=True),
    _p("div.keeps_one", "/", "divisor", "{Sub} sorts the {stuff} into {k} equal {groups} and keeps one {group}.",
       "{Sub} keeps {calc}.", "person share"),
)


def _item(one: str, many: str, tags: str, container: str = "", **kw: object) -> Item:
    box = tuple(container.split("/")) if container else None
    return Item(one, many, frozenset(tags.split()), box, **kw)  # type: ignore[arg-type]


_PERSON = ("{Name} is {d} years old.", "{His} {rel} lives {d} miles away.", "{His} {rel} has {d:q}.")
_TOYS = "buy win give lose sell share arrange"

FRAMES: tuple[Frame, ...] = (
    Frame("beach", (_item("seashell", "seashells", "find collect give lose sell share arrange", "bucket/buckets/in"),
                    _item("pebble", "pebbles", "find collect give lose share arrange", "bucket/buckets/in")),
          ("{Name} gathers {a:q} at the beach.", "{Name} brings home {a:q} from the beach."),
          distract=("The beach is {d} miles from {his} house.",) + _PERSON),
    Frame("orchard", tuple(_item(o, m, "pick buy eat give sell share arrange", "basket/baskets/in")
                           for o, m in (("apple", "apples"), ("pear", "pears"), ("plum", "plums"))),
          ("{Name} picks {a:q} at the orchard.", "{Name} brings {a:q} home from the orchard."),
          distract=("The orchard has {d} trees.",) + _PERSON),
    Frame("bakery", tuple(_item(o, m, "make buy eat give sell share arrange", "tray/trays/on")
                          for o, m in (("cookie", "cookies"), ("muffin", "muffins"), ("cupcake", "cupcakes"))),
          ("{Name} bakes {a:q} for a party.", "{Name} has {a:q} at {his} bake sale."),
          distract=("The oven is {d} years old.",) + _PERSON),
    Frame("marbles", (_item("marble", "marbles", "find " + _TOYS, "bag/bags/in"),),
          ("{Name} plays with {a:q} at recess.", "{Name} keeps {a:q} in a jar."), distract=_PERSON),
    Frame("stickers", (_item("sticker", "stickers", "buy win earn give lose use share arrange", "sheet/sheets/on"),),
          ("{Name} has {a:q} in {his} sticker book.", "{Name} gets {a:q} at school on Monday."), distract=_PERSON),
    Frame("cards", tuple(_item(o, m, _TOYS, "pack/packs/in")
                         for o, m in (("trading card", "trading cards"), ("baseball card", "baseball cards"))),
          ("{Name} owns {a:q}.", "{Name} keeps {a:q} in a binder."), distract=_PERSON),
    Frame("flowers", tuple(_item(o, m, "pick buy give sell share arrange", "vase/vases/in")
                           for o, m in (("tulip", "tulips"), ("rose", "roses"), ("daisy", "daisies"))),
          ("{Name} grows {a:q} for the flower show.", "{Name} has {a:q} in {his} flower shop."),
          distract=("The flower show is in {d} days.",) + _PERSON),
    Frame("eggs", (_item("egg", "eggs", "collect buy give sell use eat share", "carton/cartons/in"),),
          ("{Name}'s hens lay {a:q} this week.", "{Name} gathers {a:q} on the farm."),
          distract=("{Name}'s farm has {d} goats.",) + _PERSON),
    Frame("fair", (_item("ticket", "tickets", "win earn spend use lose give share", "strip/strips/on"),),
          ("{Name} has {a:q} at the fair.", "{Name} starts the day at the fair with {a:q}."),
          distract=("The fair has {d} rides.",) + _PERSON),
    Frame("savings", (MONEY,), ("{Name} has {a:q} in {his} piggy bank.", "{Name} keeps {a:q} in {his} wallet."),
          distract=("{His} piggy bank is {d} inches tall.",) + _PERSON),
    Frame("crafts", tuple(_item(o, m, "buy find give lose use share arrange", "jar/jars/in")
                          for o, m in (("bead", "beads"), ("button", "buttons"))),
          ("{Name} has {a:q} for a craft project.", "{Name} keeps {a:q} in a craft box."), distract=_PERSON),
    Frame("books", tuple(_item(o, m, "buy give sell share", "shelf/shelves/on")
                         for o, m in (("book", "books"), ("comic book", "comic books"))),
          ("{Name} has {a:q} at home.", "{Name} keeps {a:q} in {his} room."),
          distract=("{Name} reads for {d} minutes a day.",) + _PERSON),
    Frame("stamps", tuple(_item(o, m, "buy collect give sell share arrange", "album/albums/in")
                          for o, m in (("stamp", "stamps"), ("postcard", "postcards"))),
          ("{Name} has {a:q} in {his} collection.", "{Name} starts a collection with {a:q}."), distract=_PERSON),
    Frame("park", tuple(_item(o, m, "find collect give lose share arrange", "pail/pails/in")
                        for o, m in (("acorn", "acorns"), ("pinecone", "pinecones"))),
          ("{Name} gathers {a:q} in the park.", "{Name} finds {a:q} under the trees."),
          distract=("The park is {d} blocks from {his} house.",) + _PERSON, big=False),
    Frame("party", (_item("balloon", "balloons", "buy give lose sell share", "pack/packs/in"),),
          ("{Name} blows up {a:q} for a party.", "{Name} has {a:q} at {his} party."),
          distract=("The party starts in {d} minutes.",) + _PERSON, big=False),
    Frame("toys", tuple(_item(o, m, _TOYS, "box/boxes/in") for o, m in (("toy car", "toy cars"),
                                                                         ("toy robot", "toy robots"))),
          ("{Name} has {a:q} in {his} toy chest.", "{Name} keeps {a:q} on a shelf."), distract=_PERSON),
    Frame("school", tuple(_item(o, m, "buy find give lose use share", "box/boxes/in")
                          for o, m in (("pencil", "pencils"), ("crayon", "crayons"), ("eraser", "erasers"))),
          ("{Name} has {a:q} in {his} backpack.", "{Name} brings {a:q} to class."), distract=_PERSON),
    Frame("berries", tuple(_item(o, m, "pick eat buy give sell share", "bowl/bowls/in")
                           for o, m in (("strawberry", "strawberries"), ("blueberry", "blueberries"))),
          ("{Name} picks {a:q} at a berry farm.", "{Name} has {a:q} for breakfast."), distract=_PERSON, big=False),
    Frame("sewing", (_item("meter of ribbon", "meters of ribbon", "buy use give sell share", "spool/spools/on",
                           stuff="ribbon", unit=("meter", "meters")),),
          ("{Name} has {a:q} for a sewing project.", "{Name} buys {a:q} at a fabric store."), distract=_PERSON),
    Frame("lemonade", (_item("cup of lemonade", "cups of lemonade", "make sell give share", "pitcher/pitchers/in",
                             stuff="lemonade", unit=("cup", "cups")),),
          ("{Name} makes {a:q} for {his} stand.", "{Name} has {a:q} at {his} stand."),
          distract=("The stand is {d} feet from the corner.",) + _PERSON, big=False),
    Frame("garden", tuple(_item(o, m, "pick eat give sell share arrange", "crate/crates/in")
                          for o, m in (("carrot", "carrots"), ("tomato", "tomatoes"))),
          ("{Name} grows {a:q} in {his} garden.", "{Name} harvests {a:q} from {his} garden."),
          distract=("The garden is {d} meters long.",) + _PERSON, big=False),
    Frame("bus", (_item("passenger", "passengers", "ride share"),),
          ("A bus leaves the station with {a:q}.", "There are {a:q} on a city bus."), holder="the bus",
          ask="How many {items} are on {name} now?",
          distract=("The bus driver has worked for {d} years.", "The bus is {d} years old."), big=False),
    Frame("train", (_item("traveler", "travelers", "ride share"),),
          ("A train leaves the city with {a:q}.", "There are {a:q} on a night train."), holder="the train",
          ask="How many {items} are on {name} now?", distract=("The train has {d} cars.",)),
    Frame("ferry", (_item("tourist", "tourists", "ride share"),),
          ("A ferry leaves the dock with {a:q}.", "There are {a:q} on a small ferry."), holder="the ferry",
          ask="How many {items} are on {name} now?", distract=("The ferry is {d} meters long.",), big=False),
)

HELDOUT_FRAMES: tuple[str, ...] = ("stamps", "lemonade", "garden", "ferry")
"""Frames the train split never tells: a collection, a measured item, a harvest, a vehicle."""

HELDOUT_PHRASINGS: tuple[str, ...] = ("add.is_given", "add.more_than", "add.collects", "sub.gives_away", "sub.uses",
                                      "mul.rows_of", "mul.per_price", "div.each_gets", "div.same_each")
"""Phrasings the train split never uses: at least one per operation, each taught through other words."""

PEOPLE: tuple[tuple[str, bool], ...] = (
    ("Maya", True), ("Liam", False), ("Priya", True), ("Carlos", False), ("Hannah", True), ("Kenji", False),
    ("Amara", True), ("Oliver", False), ("Sofia", True), ("Mateo", False), ("Chloe", True), ("Darius", False),
    ("Lena", True), ("Ethan", False), ("Fatima", True), ("Noah", False), ("Grace", True), ("Ravi", False),
    ("Isabel", True), ("Tobias", False), ("Zoe", True), ("Marcus", False), ("Nadia", True), ("Felix", False),
)
"""(name, female): who holds the quantity in a person's frame."""
RELATIVES = ("cousin", "neighbor", "best friend", "grandmother", "uncle", "aunt", "classmate", "brother", "sister")
RECEIVERS = (("friend", "friends"), ("classmate", "classmates"), ("cousin", "cousins"), ("teammate", "teammates"),
             ("neighbor", "neighbors"))


def fill(template: str, words: Mapping[str, str], numbers: Mapping[str, int], item: Item) -> str:
    """A template written out: number fields in `item`'s words, the rest from `words`."""
    out = []
    for literal, name, spec, _ in _FORMATTER.parse(template):
        out.append(literal)
        if name is not None:
            out.append(item.amount(numbers[name], spec or "") if name in NUMBER_FIELDS else words[name])
    return "".join(out)


def tags_of(frame: Frame, item: Item) -> frozenset[str]:
    """What a phrasing's `needs` are checked against: the item's tags, `person` and `container` where they apply."""
    return item.tags | ({"person"} if frame.holder is None else set()) | ({"container"} if item.container else set())
