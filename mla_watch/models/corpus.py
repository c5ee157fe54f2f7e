"""Deterministic synthetic training corpus for the tiny bundled MoE language model.

The bundled model (about 3M parameters, byte-level BPE vocabulary of roughly 4k tokens) is trained on
four business-line domains so that its experts can specialise by domain and so that the monitoring
sidecar has realistic, domain-labelled traffic to watch:

* ``customer_service`` -- support chats in the tokenizer's chat format (``<|user|>`` / ``<|assistant|>``
  turns, optionally preceded by a ``<|system|>`` turn);
* ``code`` -- small Python modules (functions, sometimes a class) that always compile;
* ``sql`` -- commented SQL statements over a handful of coherent schemas;
* ``doc_summary`` -- a generated document paragraph followed by a summary that restates its key facts.

A plain fixed-template corpus is memorised by a model of this size (held-out perplexity near 1.0), so
every sample is composed combinatorially from many word lists, numbers, names, dates and optional
clauses, while each domain keeps a regular, learnable shape.  Samples are 300--1000 characters long.

Everything is deterministic: each call builds its own ``random.Random`` seeded with a string such as
``"sql:7"`` (string seeds are hashed with SHA-512 by :mod:`random`, so results are identical across
processes and independent of ``PYTHONHASHSEED``).  The global :mod:`random` state is never used.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["DOMAINS", "generate", "generate_mixed", "prompts"]

DOMAINS: tuple[str, ...] = ("customer_service", "code", "sql", "doc_summary")

MIN_CHARS = 300
MAX_CHARS = 1000
_MAX_ATTEMPTS = 200

# --------------------------------------------------------------------------------------------------
# Shared vocabulary
# --------------------------------------------------------------------------------------------------

_FIRST_NAMES = (
    "Alice",
    "Bruno",
    "Carmen",
    "Dmitri",
    "Elena",
    "Farid",
    "Grace",
    "Hiro",
    "Ingrid",
    "Jamal",
    "Keiko",
    "Liam",
    "Maya",
    "Nikolai",
    "Olivia",
    "Pedro",
    "Quinn",
    "Rosa",
    "Samir",
    "Tara",
    "Umar",
    "Vera",
    "Wei",
    "Ximena",
    "Yusuf",
    "Zoe",
    "Aaron",
    "Beatriz",
    "Connor",
    "Daria",
    "Emeka",
    "Fiona",
    "Gustavo",
    "Hannah",
    "Ivan",
    "Julia",
    "Kwame",
    "Leila",
    "Marco",
    "Nadia",
    "Oscar",
    "Priya",
    "Rafael",
    "Sofia",
    "Tomas",
    "Ulrike",
    "Victor",
    "Wanda",
    "Yara",
    "Zane",
)
_LAST_NAMES = (
    "Anderson",
    "Becker",
    "Castillo",
    "Dubois",
    "Eriksen",
    "Fischer",
    "Garcia",
    "Haddad",
    "Ibrahim",
    "Jensen",
    "Kowalski",
    "Lindqvist",
    "Moreau",
    "Nakamura",
    "Okafor",
    "Petrov",
    "Quintero",
    "Rossi",
    "Schneider",
    "Tanaka",
    "Usman",
    "Varga",
    "Weber",
    "Xu",
    "Yilmaz",
    "Zhang",
    "Alvarez",
    "Brennan",
    "Chowdhury",
    "Delgado",
    "Evans",
    "Ferreira",
    "Gallagher",
    "Horvath",
    "Iyer",
    "Johansson",
    "Kim",
    "Lopez",
    "Mensah",
    "Novak",
    "Olsen",
    "Patel",
    "Romero",
    "Silva",
    "Thompson",
    "Vogel",
    "Walsh",
)
_COMPANIES = (
    "Northwind Outfitters",
    "Bluepeak Electronics",
    "Cedar & Pine Home",
    "Orbital Gadgets",
    "Larkspur Books",
    "Ironclad Tools",
    "Sunfield Grocers",
    "Meridian Telecom",
    "Harbor Lane Apparel",
    "Quartz Cloud",
    "Brightwave Energy",
    "Copperleaf Furniture",
    "Velvet Fox Cosmetics",
    "Summit Sports",
    "Nimbus Travel",
    "Kestrel Software",
    "Maple Street Pharmacy",
    "Tidewater Bikes",
    "Granite Bank",
    "Aster Logistics",
    "Pebble Kitchenware",
    "Falcon Pet Supply",
    "Juniper Health",
    "Redwood Audio",
)
_BRANDS = (
    "Aurora",
    "Vertex",
    "Nova",
    "Echo",
    "Pulse",
    "Atlas",
    "Zephyr",
    "Lumen",
    "Terra",
    "Orion",
    "Nimbus",
    "Falcon",
    "Cobalt",
    "Summit",
    "Vista",
    "Ember",
    "Helix",
    "Strata",
    "Quill",
    "Arbor",
)
_PRODUCT_KINDS = (
    "wireless headphones",
    "standing desk",
    "coffee grinder",
    "running shoes",
    "smart watch",
    "air purifier",
    "office chair",
    "backpack",
    "blender",
    "laptop stand",
    "rain jacket",
    "electric kettle",
    "yoga mat",
    "bluetooth speaker",
    "desk lamp",
    "water bottle",
    "phone case",
    "robot vacuum",
    "camping tent",
    "mechanical keyboard",
    "winter boots",
    "cast iron pan",
    "baby monitor",
    "gaming mouse",
    "duvet cover",
    "portable charger",
    "tablet",
    "espresso machine",
    "bike helmet",
    "webcam",
)
_CITIES = (
    "Rotterdam",
    "Austin",
    "Lyon",
    "Osaka",
    "Toronto",
    "Leeds",
    "Porto",
    "Denver",
    "Krakow",
    "Melbourne",
    "Nairobi",
    "Seville",
    "Gothenburg",
    "Calgary",
    "Dublin",
    "Phoenix",
    "Turin",
    "Busan",
    "Leipzig",
    "Valencia",
    "Auckland",
    "Bristol",
    "Montreal",
    "Tampere",
    "Cork",
    "Graz",
    "Hamburg",
    "Nantes",
)
_STREETS = (
    "Oak Street",
    "Maple Avenue",
    "Harbor Road",
    "King's Lane",
    "Station Road",
    "Elm Drive",
    "Mill Lane",
    "Park Crescent",
    "River Walk",
    "Church Street",
    "Hillside Way",
    "Market Square",
    "Birch Close",
)
_MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
_WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_CURRENCY_SYMBOLS = ("$", "€", "£")
_REGIONS = ("North America", "EMEA", "APAC", "Latin America", "the Nordics", "Southern Europe", "DACH")
_TEAMS = (
    "platform",
    "payments",
    "growth",
    "data engineering",
    "mobile",
    "logistics",
    "customer success",
    "security",
    "finance",
    "marketing",
    "infrastructure",
    "search",
    "procurement",
    "billing",
)


def _pick(rng: random.Random, options: Sequence[str]) -> str:
    return options[rng.randrange(len(options))]


def _maybe(rng: random.Random, probability: float, text: str) -> str:
    return text if rng.random() < probability else ""


def _full_name(rng: random.Random) -> str:
    return f"{_pick(rng, _FIRST_NAMES)} {_pick(rng, _LAST_NAMES)}"


def _product(rng: random.Random) -> str:
    return f"{_pick(rng, _BRANDS)} {_pick(rng, _PRODUCT_KINDS)}"


def _money(rng: random.Random, symbol: str, low: float, high: float) -> str:
    value = rng.uniform(low, high)
    if rng.random() < 0.3:
        return f"{symbol}{round(value):,}"
    return f"{symbol}{value:,.2f}"


def _date(rng: random.Random, year: int | None = None) -> str:
    year = year if year is not None else rng.randint(2022, 2025)
    month = rng.randint(1, 12)
    day = rng.randint(1, 28)
    style = rng.randrange(3)
    if style == 0:
        return f"{_MONTHS[month - 1]} {day}"
    if style == 1:
        return f"{_MONTHS[month - 1]} {day}, {year}"
    return f"{year}-{month:02d}-{day:02d}"


def _iso_date(rng: random.Random, year: int) -> str:
    return f"{year}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _sentence_join(parts: Sequence[str]) -> str:
    return " ".join(part for part in parts if part)


# --------------------------------------------------------------------------------------------------
# customer_service
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Topic:
    """Templates for one support topic; placeholders are filled from :func:`_cs_context`."""

    openers: tuple[str, ...]
    replies: tuple[str, ...]
    followups: tuple[tuple[str, str], ...]


_CS_TOPICS: dict[str, _Topic] = {
    "order_status": _Topic(
        openers=(
            "I placed order {order} on {date} for a {product} and it still says processing. "
            "Can you check what is going on?",
            "Could you tell me the status of my order {order}? It was the {product}, I paid {amount}.",
            "My order number is {order}. I ordered a {product} on {date} and haven't had any update since.",
            "Where is my {product}? Order {order}, placed {days} days ago.",
        ),
        replies=(
            "I checked order {order}: the {product} was packed on {date2} and should ship within {days} "
            "business days. You will receive tracking number {tracking} by email.",
            "I can see order {order} for {amount}. It is currently at our {city} warehouse and is scheduled "
            "to leave in {days} days.",
            "Order {order} is confirmed and paid ({amount}). The {product} is being prepared and the "
            "estimated delivery date is {new_date}.",
        ),
        followups=(
            (
                "Can I still add another item to it?",
                "Unfortunately order {order} is already packed, so I can't add items, but a new order placed "
                "today would arrive around {new_date}.",
            ),
            (
                "Will I get an email when it ships?",
                "Yes, a shipping confirmation with tracking number {tracking} will be sent to {email}.",
            ),
            (
                "Is there any way to speed it up?",
                "I can upgrade order {order} to express shipping at no cost, which saves about {days} days.",
            ),
        ),
    ),
    "refund": _Topic(
        openers=(
            "I returned the {product} from order {order} on {date} but I still haven't received my refund of {amount}.",
            "I'd like a refund for order {order}. The {product} doesn't fit my needs and I paid {amount}.",
            "When will I get my money back for order {order}? The refund was approved {days} days ago.",
        ),
        replies=(
            "I've located your return for order {order}. The refund of {amount} was issued on {date2} and "
            "usually takes {days} business days to appear on your card ending in {card}.",
            "I'm sorry for the wait. I have approved a refund of {amount} for order {order}; you should "
            "see it within {days} days.",
            "Your refund request for the {product} is registered under case {ticket}. Once the item "
            "reaches our {city} warehouse we will refund {amount}.",
        ),
        followups=(
            (
                "Will the shipping cost be refunded too?",
                "Yes, the original shipping fee of {fee} is included, so the total refund is {amount} plus {fee}.",
            ),
            (
                "Can I get store credit instead?",
                "Of course. I can convert the refund into store credit of {amount}, available immediately "
                "on your account.",
            ),
            (
                "Do I need to print a return label?",
                "No label is needed; just show case number {ticket} at any drop-off point within {days} days.",
            ),
        ),
    ),
    "shipping_delay": _Topic(
        openers=(
            "My package for order {order} was supposed to arrive on {date} and it's still not here.",
            "The tracking for {tracking} hasn't moved in {days} days. What is happening with my {product}?",
            "Order {order} is late. I needed the {product} before {new_date}. Can you help?",
        ),
        replies=(
            "I apologise for the delay. The carrier reports that parcel {tracking} is held at the {city} "
            "depot and should be delivered within {days} days.",
            "I've contacted the courier about order {order}. Because of the delay I've added a {fee} "
            "credit to your account.",
            "The shipment for order {order} was delayed by weather in {city}. The new delivery estimate is {new_date}.",
        ),
        followups=(
            (
                "What if it doesn't arrive by then?",
                "If order {order} has not arrived by {new_date}, we will send a replacement {product} by "
                "express at no charge.",
            ),
            (
                "Can I pick it up myself?",
                "Yes, you can collect it from the {city} depot with tracking number {tracking} and a photo ID.",
            ),
            (
                "Can you refund the shipping fee?",
                "Certainly, I've refunded the shipping fee of {fee} to your card ending in {card}.",
            ),
        ),
    ),
    "login": _Topic(
        openers=(
            "I can't log into my account. It says my password is wrong but I just reset it.",
            "Hi, my account {email} is locked after too many login attempts. Can you unlock it?",
            "I'm not receiving the verification code when I try to sign in with {email}.",
        ),
        replies=(
            "I've unlocked the account for {email}. Please reset your password using the link I sent; it "
            "expires in {hours} hours.",
            "For security I've sent a one-time code to {email}. It is valid for {minutes} minutes.",
            "I see {attempts} failed attempts on {email} today, so the account was locked. It is unlocked "
            "now and you can sign in again.",
        ),
        followups=(
            (
                "The link says it has expired.",
                "I've issued a new reset link to {email}; this one is valid for {hours} hours.",
            ),
            (
                "Can I change the email on the account?",
                "Yes, once you are signed in go to Settings, then Profile. A confirmation goes to {email} first.",
            ),
            (
                "Should I turn on two-factor authentication?",
                "We recommend it. You can enable it under Security; it takes about {minutes} minutes.",
            ),
        ),
    ),
    "billing": _Topic(
        openers=(
            "I was charged {amount} twice on {date}. Can you look into it?",
            "My invoice for {month} shows {amount}, but my plan is only {price} a month.",
            "Why was my card ending in {card} charged {amount}? I don't recognise this payment.",
        ),
        replies=(
            "You're right, there is a duplicate charge of {amount} from {date}. I've reversed it and you "
            "will see the credit within {days} business days.",
            "The {month} invoice includes {amount} because the {plan} plan renewed on {date2}. I can "
            "switch you back to the {price} plan from next month.",
            "That charge of {amount} is for order {order} placed on {date}. If you did not place it, I "
            "can open dispute case {ticket}.",
        ),
        followups=(
            (
                "Can I get a copy of the invoice?",
                "I've emailed the invoice for {amount} to {email}; you can also download it from Billing.",
            ),
            ("Will this affect my next payment?", "No, your next payment of {price} on {new_date} is unchanged."),
            (
                "Can I pay by bank transfer instead?",
                "Yes, bank transfer is available. Please use reference {ticket} so we can match the payment.",
            ),
        ),
    ),
    "warranty": _Topic(
        openers=(
            "My {product} stopped working after {months} months. Is it still under warranty?",
            "The {product} from order {order} makes a loud noise. I bought it on {date} for {amount}.",
            "I'd like to make a warranty claim for my {product}; the screen went dark yesterday.",
        ),
        replies=(
            "Your {product} is covered by a {warranty}-month warranty, so we can repair or replace it. "
            "I've opened claim {ticket}.",
            "Thanks for the details. Order {order} was delivered on {date2}, so the {product} is still "
            "under warranty until {new_date}.",
            "I'm sorry about that. Please send a short video of the issue quoting claim {ticket} and we "
            "will ship a replacement within {days} days.",
        ),
        followups=(
            (
                "Do I have to pay for shipping?",
                "No, the return shipping for claim {ticket} is free; a prepaid label is on its way to {email}.",
            ),
            (
                "Can I get a refund instead of a replacement?",
                "Yes, under the warranty we can refund the full {amount} once the {product} is received.",
            ),
            (
                "How long does a repair take?",
                "Repairs usually take {days} business days after the {product} arrives at our {city} centre.",
            ),
        ),
    ),
    "cancellation": _Topic(
        openers=(
            "Please cancel order {order}. I ordered the wrong {product}.",
            "I want to cancel my {plan} subscription before it renews on {new_date}.",
            "Can I still cancel order {order}? It was placed {hours} hours ago.",
        ),
        replies=(
            "Order {order} has been cancelled and the {amount} will be returned to your card ending in "
            "{card} within {days} days.",
            "I've cancelled the {plan} subscription. You keep access until {new_date} and will not be "
            "charged {price} again.",
            "The order had not shipped yet, so I was able to cancel order {order}. A confirmation was sent to {email}.",
        ),
        followups=(
            (
                "Can I reorder the right size?",
                "Sure, I've placed a new order for the {product} in the correct size; it ships in {days} days.",
            ),
            (
                "Will I lose my saved data?",
                "Your data is kept for {days} days after {new_date}, so you can reactivate without losing it.",
            ),
            ("Is there a cancellation fee?", "No, there is no fee for cancelling order {order} before it ships."),
        ),
    ),
    "address_change": _Topic(
        openers=(
            "I moved last week. Can you change the delivery address for order {order} to {address}?",
            "I typed the wrong address for order {order}. It should be {address}.",
            "Please update my shipping address to {address}, {city}. I have an order arriving on {date}.",
        ),
        replies=(
            "I've updated order {order} to ship to {address}, {city}. The delivery date stays {new_date}.",
            "Since order {order} hasn't left the warehouse, I changed the address to {address}. There is "
            "no extra charge.",
            "The parcel is already with the courier, so I requested a redirect to {address}. It may add "
            "{days} days to delivery.",
        ),
        followups=(
            (
                "Will future orders go to the new address too?",
                "Yes, I've also saved {address}, {city} as the default address on your account.",
            ),
            (
                "Do I need to confirm anything?",
                "Just the confirmation email sent to {email}; please click the link within {hours} hours.",
            ),
            ("Can someone else sign for it?", "Yes, anyone at {address} can sign for order {order}."),
        ),
    ),
    "damaged_item": _Topic(
        openers=(
            "The {product} from order {order} arrived damaged. The box was crushed and it won't turn on.",
            "I received my {product} today but the glass is cracked. Order {order}, paid {amount}.",
            "Half of the items in order {order} were broken on arrival. What can I do?",
        ),
        replies=(
            "I'm very sorry about that. I've arranged a free replacement {product} for order {order}; "
            "it will arrive within {days} days.",
            "Thank you for letting us know. Please keep the packaging; I've opened damage report {ticket} "
            "and a refund of {amount} is approved.",
            "That should not have happened. I've issued a {fee} credit and a replacement for order "
            "{order}, shipping today from {city}.",
        ),
        followups=(
            (
                "Do I need to send the broken one back?",
                "No need, please recycle it. Damage report {ticket} covers the full {amount}.",
            ),
            (
                "Can I have a different colour?",
                "Certainly, the replacement {product} will be sent in the colour you prefer at no extra cost.",
            ),
            (
                "Should I send photos?",
                "Photos help: reply to the email sent to {email} with claim {ticket} in the subject line.",
            ),
        ),
    ),
}

_CS_TOPIC_NAMES: tuple[str, ...] = tuple(_CS_TOPICS)

_CS_USER_GREETINGS = (
    "",
    "",
    "Hi,",
    "Hello,",
    "Hi there.",
    "Good morning.",
    "Good evening,",
    "Hey,",
    "Hello team,",
    "Hi, this is {name}.",
    "Hello, my name is {name}.",
)
_CS_USER_CLOSERS = (
    "",
    "",
    "",
    "Thanks.",
    "Thank you!",
    "Please help.",
    "This is urgent.",
    "Thanks in advance.",
    "I'd appreciate a quick reply.",
    "It's the second time I'm writing about this.",
)
_CS_AGENT_OPENERS = (
    "Thanks for reaching out, {first}.",
    "Hi {first}, happy to help.",
    "I'm sorry to hear that, {first}.",
    "Thank you for your patience, {first}.",
    "Hello {first}!",
    "Thanks for the details.",
    "Hi {first}, thanks for contacting {company}.",
    "I understand, {first}.",
)
_CS_AGENT_CLOSERS = (
    "",
    "",
    "Is there anything else I can help with?",
    "Let me know if you have other questions.",
    "Have a great day!",
    "Thanks for shopping with {company}.",
    "Anything else I can do for you today?",
)
_CS_GENERIC_FOLLOWUPS = (
    ("Thank you so much!", "You're welcome, {first}! Have a lovely {weekday}."),
    ("Great, thanks for the quick help.", "My pleasure. Your case number is {ticket} if you need it."),
    ("Could you send me that in writing?", "Of course, a summary of this chat has been sent to {email}."),
    ("OK. How can I contact you again?", "Just reply to the email at {email} or quote case {ticket} in a new chat."),
)
_CS_SYSTEM_PROMPTS = (
    "You are a support agent for {company}.",
    "You are a friendly customer service assistant for {company}. Be concise and polite.",
    "You are {agent}, a support specialist at {company}. Reference order details when you answer.",
    "You help customers of {company} with orders, billing and returns.",
)
_PLANS = ("Basic", "Plus", "Premium", "Family", "Pro", "Business", "Starter", "Unlimited")


def _order_number(rng: random.Random) -> str:
    style = rng.randrange(3)
    if style == 0:
        return f"#{rng.randint(10000, 999999)}"
    if style == 1:
        return f"{rng.choice('ABCDEFGHKMNPRSTW')}-{rng.randint(100000, 9999999)}"
    return f"ORD-{rng.randint(2022, 2025)}-{rng.randint(1000, 99999)}"


def _cs_context(rng: random.Random) -> dict[str, str]:
    first, last = _pick(rng, _FIRST_NAMES), _pick(rng, _LAST_NAMES)
    symbol = _pick(rng, _CURRENCY_SYMBOLS)
    domain = _pick(rng, ("mail.com", "example.org", "inbox.net", "post.io", "webmail.eu"))
    sep = _pick(rng, (".", "_", ""))
    suffix = str(rng.randint(1, 99)) if rng.random() < 0.4 else ""
    return {
        "first": first,
        "name": f"{first} {last}",
        "email": f"{first.lower()}{sep}{last.lower()}{suffix}@{domain}",
        "company": _pick(rng, _COMPANIES),
        "agent": _pick(rng, _FIRST_NAMES),
        "order": _order_number(rng),
        "product": _product(rng),
        "amount": _money(rng, symbol, 9, 1500),
        "price": _money(rng, symbol, 4, 60),
        "fee": _money(rng, symbol, 3, 25),
        "date": _date(rng),
        "date2": _date(rng),
        "new_date": _date(rng),
        "month": _pick(rng, _MONTHS),
        "weekday": _pick(rng, _WEEKDAYS),
        "days": str(rng.randint(2, 14)),
        "hours": str(rng.choice((2, 4, 6, 12, 24, 48, 72))),
        "minutes": str(rng.choice((5, 10, 15, 30))),
        "months": str(rng.randint(2, 30)),
        "warranty": str(rng.choice((12, 18, 24, 36))),
        "attempts": str(rng.randint(3, 9)),
        "tracking": f"{rng.choice(('1Z', 'JD', 'TB', 'PX'))}{rng.randint(10**8, 10**10 - 1)}",
        "ticket": f"{rng.choice(('CS', 'CASE', 'RMA', 'TKT'))}-{rng.randint(1000, 99999)}",
        "card": f"{rng.randint(0, 9999):04d}",
        "city": _pick(rng, _CITIES),
        "address": f"{rng.randint(1, 250)} {_pick(rng, _STREETS)}",
        "plan": _pick(rng, _PLANS),
    }


def _cs_user_message(rng: random.Random, ctx: dict[str, str], body: str) -> str:
    greeting = _pick(rng, _CS_USER_GREETINGS)
    if greeting.endswith(",") and not body.startswith("I "):
        body = body[0].lower() + body[1:]
    text = _sentence_join((greeting, body, _pick(rng, _CS_USER_CLOSERS))).format(**ctx)
    return text.lower() if rng.random() < 0.08 else text


def _cs_agent_message(rng: random.Random, ctx: dict[str, str], body: str, closing: bool) -> str:
    opener = _pick(rng, _CS_AGENT_OPENERS) if rng.random() < 0.8 else ""
    closer = _pick(rng, _CS_AGENT_CLOSERS) if closing else ""
    return _sentence_join((opener, body, closer)).format(**ctx)


def _render_turn(role: str, text: str) -> str:
    return f"<|{role}|>\n{text}\n"


def _cs_exchanges(rng: random.Random, ctx: dict[str, str], topic: _Topic) -> list[tuple[str, str]]:
    """Return 1--3 (user, assistant) message pairs for one conversation."""
    n_exchanges = rng.choice((1, 2, 2, 3))
    followups = list(topic.followups)
    rng.shuffle(followups)
    bodies = [(_pick(rng, topic.openers), _pick(rng, topic.replies))]
    bodies.extend(followups[: n_exchanges - 1])
    if n_exchanges > 1 and rng.random() < 0.35:
        bodies[-1] = _CS_GENERIC_FOLLOWUPS[rng.randrange(len(_CS_GENERIC_FOLLOWUPS))]
    exchanges = []
    for index, (user_body, agent_body) in enumerate(bodies):
        user = _cs_user_message(rng, ctx, user_body) if index == 0 else user_body.format(**ctx)
        closing = index == len(bodies) - 1 and rng.random() < 0.6
        agent = _cs_agent_message(rng, ctx, agent_body, closing) if index == 0 else agent_body.format(**ctx)
        if index > 0 and closing:
            agent = _sentence_join((agent, _pick(rng, _CS_AGENT_CLOSERS).format(**ctx)))
        exchanges.append((user, agent))
    return exchanges


def _customer_service(rng: random.Random, allow_system: bool = True) -> str:
    ctx = _cs_context(rng)
    topic = _CS_TOPICS[_pick(rng, _CS_TOPIC_NAMES)]
    turns = []
    if allow_system and rng.random() < 0.3:
        turns.append(_render_turn("system", _pick(rng, _CS_SYSTEM_PROMPTS).format(**ctx)))
    for user, agent in _cs_exchanges(rng, ctx, topic):
        turns.append(_render_turn("user", user))
        turns.append(_render_turn("assistant", agent))
    return "".join(turns)


def _customer_service_prompt(rng: random.Random) -> str:
    sample = _customer_service(rng, allow_system=False)
    cut = sample.index("<|assistant|>\n") + len("<|assistant|>\n")
    return sample[:cut]


# --------------------------------------------------------------------------------------------------
# code
# --------------------------------------------------------------------------------------------------

_VERBS = (
    "parse",
    "count",
    "compute",
    "load",
    "filter",
    "merge",
    "normalize",
    "summarize",
    "validate",
    "format",
    "group",
    "rank",
    "find",
    "collect",
    "build",
    "score",
    "estimate",
    "aggregate",
    "resolve",
    "extract",
    "select",
    "total",
    "index",
    "clean",
    "bucket",
    "split",
    "match",
    "apply",
    "prepare",
    "measure",
)
_NOUNS = (
    "invoice",
    "user",
    "order",
    "payment",
    "session",
    "ticket",
    "record",
    "event",
    "item",
    "shipment",
    "account",
    "product",
    "review",
    "transaction",
    "metric",
    "report",
    "customer",
    "batch",
    "entry",
    "request",
    "booking",
    "claim",
    "device",
    "employee",
    "lead",
    "subscription",
    "reading",
    "visit",
)
_QUALIFIERS = (
    "active",
    "pending",
    "recent",
    "daily",
    "monthly",
    "valid",
    "overdue",
    "top",
    "failed",
    "open",
    "weekly",
    "late",
    "unpaid",
    "new",
    "flagged",
    "archived",
)
_NUM_FIELDS = (
    "amount",
    "price",
    "quantity",
    "score",
    "duration",
    "weight",
    "balance",
    "latency_ms",
    "total",
    "discount",
    "rating",
    "cost",
    "count",
    "hours",
    "distance_km",
    "tax",
)
_STR_FIELDS = ("name", "status", "region", "category", "email", "country", "channel", "owner", "plan", "team")
_STATUS_VALUES = (
    "active",
    "pending",
    "closed",
    "paid",
    "failed",
    "shipped",
    "open",
    "archived",
    "approved",
    "draft",
)
_LABELS = ("low", "medium", "high", "critical", "small", "large", "cheap", "premium", "slow", "fast", "ok")
_PARAM_NAMES = ("items", "records", "rows", "entries", "data", "values", "batch", "payload")


@dataclass
class _CodeParts:
    """Accumulates the rendered blocks and the imports they need."""

    imports: set[str]
    blocks: list[str]
    names: set[str]


def _ident(rng: random.Random, used: set[str]) -> tuple[str, str]:
    """Return a fresh ``verb_[qualifier_]noun`` function name and its noun."""
    while True:
        noun = _pick(rng, _NOUNS)
        qualifier = _maybe(rng, 0.4, _pick(rng, _QUALIFIERS) + "_")
        plural = "s" if rng.random() < 0.5 else ""
        name = f"{_pick(rng, _VERBS)}_{qualifier}{noun}{plural}"
        if name not in used:
            used.add(name)
            return name, noun


def _docstring(rng: random.Random, text: str) -> str:
    return f'    """{text[0].upper()}{text[1:]}."""' if rng.random() < 0.85 else ""


def _fn_filter_sum(rng: random.Random, parts: _CodeParts) -> str:
    name, noun = _ident(rng, parts.names)
    param, field = _pick(rng, _PARAM_NAMES), _pick(rng, _NUM_FIELDS)
    threshold, factor = rng.randint(0, 500), round(rng.uniform(0.5, 2.5), 2)
    var = _pick(rng, ("total", "acc", "result", "running"))
    lines = [
        f"def {name}({param}: list[dict[str, float]], threshold: float = {threshold}) -> float:",
        _docstring(rng, f"return the weighted {field} of {noun}s above the threshold"),
        f"    {var} = 0.0",
        f"    for {noun} in {param}:",
        f'        if {noun}["{field}"] > threshold:',
        f'            {var} += {noun}["{field}"] * {factor}',
        f"    return round({var}, {rng.randint(1, 4)})",
    ]
    return "\n".join(line for line in lines if line)


def _fn_group_count(rng: random.Random, parts: _CodeParts) -> str:
    name, noun = _ident(rng, parts.names)
    param, key = _pick(rng, _PARAM_NAMES), _pick(rng, _STR_FIELDS)
    if rng.random() < 0.5:
        parts.imports.add("from collections import Counter")
        body = [f'    return dict(Counter(row["{key}"] for row in {param}))']
    else:
        parts.imports.add("from collections import defaultdict")
        field = _pick(rng, _NUM_FIELDS)
        body = [
            "    groups: defaultdict[str, float] = defaultdict(float)",
            f"    for row in {param}:",
            f'        groups[row["{key}"]] += row.get("{field}", 0)',
            "    return dict(groups)",
        ]
    lines = [
        f"def {name}({param}: list[dict]) -> dict[str, float]:",
        _docstring(rng, f"group {noun}s by {key} and aggregate them"),
        *body,
    ]
    return "\n".join(line for line in lines if line)


def _fn_label(rng: random.Random, parts: _CodeParts) -> str:
    name, noun = _ident(rng, parts.names)
    field = _pick(rng, _NUM_FIELDS)
    labels = rng.sample(_LABELS, 3)
    low = rng.randint(1, 100)
    high = low + rng.randint(10, 900)
    lines = [
        f"def {name}({field}: float) -> str:",
        _docstring(rng, f"classify a {noun} by its {field}"),
        f"    if {field} < {low}:",
        f'        return "{labels[0]}"',
        f"    elif {field} < {high}:",
        f'        return "{labels[1]}"',
        f'    return "{labels[2]}"',
    ]
    return "\n".join(line for line in lines if line)


def _fn_format(rng: random.Random, parts: _CodeParts) -> str:
    name, noun = _ident(rng, parts.names)
    key, field = _pick(rng, _STR_FIELDS), _pick(rng, _NUM_FIELDS)
    width = rng.choice((8, 10, 12, 16, 20))
    sep = _pick(rng, (" | ", ": ", " - ", ", "))
    lines = [
        f'def {name}({noun}: dict[str, object], prefix: str = "{_pick(rng, _QUALIFIERS)}") -> str:',
        _docstring(rng, f"render a one-line label for a {noun}"),
        f'    label = str({noun}.get("{key}", "unknown")).strip().title()',
        f'    value = float({noun}.get("{field}", 0))',
        f'    return f"{{prefix}}{sep}{{label:<{width}}}{sep}{{value:.{rng.randint(0, 3)}f}}"',
    ]
    return "\n".join(line for line in lines if line)


def _fn_select_sorted(rng: random.Random, parts: _CodeParts) -> str:
    name, noun = _ident(rng, parts.names)
    param, key, field = _pick(rng, _PARAM_NAMES), _pick(rng, _STR_FIELDS), _pick(rng, _NUM_FIELDS)
    status = _pick(rng, _STATUS_VALUES)
    limit = rng.randint(3, 50)
    reverse = _pick(rng, ("True", "False"))
    lines = [
        f"def {name}({param}: list[dict], limit: int = {limit}) -> list[dict]:",
        _docstring(rng, f"return the {status} {noun}s sorted by {field}"),
        f'    selected = [row for row in {param} if row.get("{key}") == "{status}"]',
        f'    selected.sort(key=lambda row: row["{field}"], reverse={reverse})',
        "    return selected[:limit]",
    ]
    return "\n".join(line for line in lines if line)


def _fn_find(rng: random.Random, parts: _CodeParts) -> str:
    name, noun = _ident(rng, parts.names)
    param, key = _pick(rng, _PARAM_NAMES), _pick(rng, ("id", f"{noun}_id", "email", "code", "sku"))
    arg_type = "int" if key.endswith("id") else "str"
    lines = [
        f"def {name}({param}: list[dict], {key}: {arg_type}) -> dict | None:",
        _docstring(rng, f"find the first {noun} with the given {key}"),
        f"    for candidate in {param}:",
        f'        if candidate.get("{key}") == {key}:',
        "            return candidate",
        "    return None",
    ]
    return "\n".join(line for line in lines if line)


def _fn_ratio(rng: random.Random, parts: _CodeParts) -> str:
    name, noun = _ident(rng, parts.names)
    a, b = rng.sample(_NUM_FIELDS, 2)
    scale = rng.choice((1, 100, 1000))
    if rng.random() < 0.4:
        parts.imports.add("import math")
        expr = f"math.sqrt({a} * {a} + {b} * {b})"
        doc = f"return the magnitude of {a} and {b} for a {noun}"
        guard: list[str] = []
    else:
        expr = f"{a} / {b}" if scale == 1 else f"{a} / {b} * {scale}"
        doc = f"return the {a} to {b} ratio of a {noun}"
        fallback = _pick(rng, ("0.0", "-1.0", 'float("nan")'))
        guard = [f"    if {b} == 0:", f"        return {fallback}"]
    lines = [
        f"def {name}({a}: float, {b}: float) -> float:",
        _docstring(rng, doc),
        *guard,
        f"    return {expr}",
    ]
    return "\n".join(line for line in lines if line)


def _fn_dict_comp(rng: random.Random, parts: _CodeParts) -> str:
    name, noun = _ident(rng, parts.names)
    param, key, field = _pick(rng, _PARAM_NAMES), _pick(rng, _STR_FIELDS), _pick(rng, _NUM_FIELDS)
    rate = round(rng.uniform(0.01, 0.4), 3)
    op = _pick(rng, ("*", "+", "-"))
    lines = [
        f"def {name}({param}: list[dict], rate: float = {rate}) -> dict[str, float]:",
        _docstring(rng, f"map each {noun} {key} to its adjusted {field}"),
        f'    return {{row["{key}"]: row["{field}"] {op} row["{field}"] * rate for row in {param}}}',
    ]
    return "\n".join(line for line in lines if line)


def _fn_dates(rng: random.Random, parts: _CodeParts) -> str:
    name, noun = _ident(rng, parts.names)
    parts.imports.add("from datetime import date, timedelta")
    days = rng.randint(3, 120)
    lines = [
        f"def {name}(start: date, periods: int = {rng.randint(2, 12)}) -> list[date]:",
        _docstring(rng, f"return the due dates of a {noun} every {days} days"),
        f"    return [start + timedelta(days={days} * step) for step in range(periods)]",
    ]
    return "\n".join(line for line in lines if line)


def _fn_regex(rng: random.Random, parts: _CodeParts) -> str:
    name, noun = _ident(rng, parts.names)
    parts.imports.add("import re")
    prefix = _pick(rng, ("INV", "ORD", "TKT", "SKU", "USR", "PAY", "REQ"))
    digits = rng.randint(3, 8)
    lines = [
        f"def {name}(text: str) -> list[str]:",
        _docstring(rng, f"extract {noun} codes such as {prefix}-{'1' * digits}"),
        f'    return re.findall(r"{prefix}-\\d{{{digits}}}", text)',
    ]
    return "\n".join(line for line in lines if line)


def _class_block(rng: random.Random, parts: _CodeParts) -> str:
    noun = _pick(rng, _NOUNS)
    suffix = _pick(rng, ("Tracker", "Summary", "Registry", "Ledger", "Counter", "Buffer", "Stats"))
    cls = f"{noun.title()}{suffix}"
    field = _pick(rng, _NUM_FIELDS)
    limit = rng.randint(10, 5000)
    docstring = [f'    """Keep a running {field} for {noun}s."""', ""] if rng.random() < 0.8 else []
    lines = [
        f"class {cls}:",
        *docstring,
        f"    def __init__(self, limit: float = {limit}) -> None:",
        "        self.limit = limit",
        f"        self.{field}: list[float] = []",
        "",
        "    def add(self, value: float) -> bool:",
        "        if value > self.limit:",
        "            return False",
        f"        self.{field}.append(value)",
        "        return True",
        "",
        "    def mean(self) -> float:",
        f"        return sum(self.{field}) / len(self.{field}) if self.{field} else 0.0",
    ]
    return "\n".join(lines)


_TOP_LEVEL_DEF = re.compile(r"^def \w+\(", re.MULTILINE)
_CODE_BUILDERS: tuple[Callable[[random.Random, _CodeParts], str], ...] = (
    _fn_filter_sum,
    _fn_group_count,
    _fn_label,
    _fn_format,
    _fn_select_sorted,
    _fn_find,
    _fn_ratio,
    _fn_dict_comp,
    _fn_dates,
    _fn_regex,
)


def _render_code(parts: _CodeParts) -> str:
    header = "\n".join(sorted(parts.imports))
    body = "\n\n\n".join(parts.blocks)
    return f"{header}\n\n\n{body}\n" if header else f"{body}\n"


def _code(rng: random.Random) -> str:
    parts = _CodeParts(imports=set(), blocks=[], names=set())
    target = rng.choice((1, 2, 2, 3, 3))
    if rng.random() < 0.25:
        parts.blocks.append(_class_block(rng, parts))
        target += 1
    while len(parts.blocks) < target or len(_render_code(parts)) < MIN_CHARS:
        builder = _CODE_BUILDERS[rng.randrange(len(_CODE_BUILDERS))]
        parts.blocks.append(builder(rng, parts))
    if rng.random() < 0.5:
        rng.shuffle(parts.blocks)
    return _render_code(parts)


def _code_prompt(rng: random.Random) -> str:
    sample = _code(rng)
    match = _TOP_LEVEL_DEF.search(sample)
    if match is None:  # pragma: no cover - every sample has at least one top-level function
        return sample[:120]
    def_at, paren = match.start(), match.end()
    line_end = sample.index("\n", def_at)
    candidates = [sample[:paren], sample[def_at:paren], sample[def_at : line_end + 1]]
    if sample.startswith('    """', line_end + 1):
        candidates.append(sample[def_at : line_end + 8])
    fitting = [c for c in candidates if 20 <= len(c) <= 120]
    return _pick(rng, fitting) if fitting else sample[def_at : def_at + 120]


# --------------------------------------------------------------------------------------------------
# sql
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Table:
    name: str
    alias: str
    key: str
    measures: tuple[tuple[str, str, str], ...]  # (aggregate, column, phrase)
    dims: tuple[str, ...]
    date_col: str
    filters: tuple[tuple[str, tuple[str, ...]], ...]
    noun: str


@dataclass(frozen=True)
class _Join:
    table: str
    alias: str
    on: str  # with {f} for the fact alias
    dims: tuple[str, ...]


@dataclass(frozen=True)
class _Schema:
    fact: _Table
    joins: tuple[_Join, ...]
    insert_cols: tuple[str, ...]


_SCHEMAS: tuple[_Schema, ...] = (
    _Schema(
        fact=_Table(
            name="orders",
            alias="o",
            key="order_id",
            noun="orders",
            measures=(
                ("SUM", "total_amount", "total revenue"),
                ("AVG", "total_amount", "average order value"),
                ("COUNT", "*", "number of orders"),
                ("AVG", "discount", "average discount"),
                ("MAX", "total_amount", "largest order"),
            ),
            dims=("region", "status", "channel"),
            date_col="order_date",
            filters=(
                ("status", ("shipped", "delivered", "cancelled", "returned")),
                ("channel", ("web", "mobile", "store", "partner")),
            ),
        ),
        joins=(
            _Join("customers", "c", "c.customer_id = {f}.customer_id", ("segment", "country")),
            _Join("products", "p", "p.product_id = {f}.product_id", ("category", "brand")),
        ),
        insert_cols=("customer_id", "product_id", "region", "status", "order_date", "total_amount"),
    ),
    _Schema(
        fact=_Table(
            name="sessions",
            alias="s",
            key="session_id",
            noun="sessions",
            measures=(
                ("COUNT", "*", "number of sessions"),
                ("AVG", "duration_sec", "average session length"),
                ("SUM", "pages_viewed", "total page views"),
                ("COUNT", "DISTINCT user_id", "number of unique users"),
            ),
            dims=("device", "browser", "country"),
            date_col="started_at",
            filters=(
                ("device", ("desktop", "ios", "android", "tablet")),
                ("browser", ("chrome", "firefox", "safari", "edge")),
            ),
        ),
        joins=(
            _Join("users", "u", "u.user_id = {f}.user_id", ("plan", "signup_source")),
            _Join("subscriptions", "sb", "sb.user_id = {f}.user_id", ("tier", "billing_period")),
        ),
        insert_cols=("user_id", "device", "browser", "started_at", "duration_sec"),
    ),
    _Schema(
        fact=_Table(
            name="stock_levels",
            alias="sl",
            key="sku",
            noun="stock entries",
            measures=(
                ("SUM", "quantity", "total units in stock"),
                ("AVG", "quantity", "average stock level"),
                ("COUNT", "*", "number of SKUs"),
                ("MIN", "quantity", "lowest stock level"),
            ),
            dims=("category", "bin_zone"),
            date_col="updated_at",
            filters=(
                ("category", ("electronics", "apparel", "grocery", "furniture", "toys")),
                ("bin_zone", ("A", "B", "C", "cold")),
            ),
        ),
        joins=(
            _Join("warehouses", "w", "w.warehouse_id = {f}.warehouse_id", ("city", "region")),
            _Join("suppliers", "sp", "sp.supplier_id = {f}.supplier_id", ("country", "supplier_name")),
        ),
        insert_cols=("sku", "warehouse_id", "supplier_id", "category", "quantity", "updated_at"),
    ),
    _Schema(
        fact=_Table(
            name="tickets",
            alias="t",
            key="ticket_id",
            noun="tickets",
            measures=(
                ("COUNT", "*", "number of tickets"),
                ("AVG", "satisfaction", "average satisfaction score"),
                ("AVG", "resolution_hours", "average resolution time"),
                ("MAX", "resolution_hours", "slowest resolution"),
            ),
            dims=("priority", "channel", "status"),
            date_col="created_at",
            filters=(
                ("priority", ("low", "medium", "high", "urgent")),
                ("status", ("open", "pending", "resolved", "closed")),
                ("channel", ("email", "chat", "phone")),
            ),
        ),
        joins=(
            _Join("agents", "a", "a.agent_id = {f}.agent_id", ("team", "agent_name")),
            _Join("customers", "c", "c.customer_id = {f}.customer_id", ("segment", "country")),
        ),
        insert_cols=("customer_id", "agent_id", "priority", "status", "channel", "created_at"),
    ),
    _Schema(
        fact=_Table(
            name="invoices",
            alias="inv",
            key="invoice_id",
            noun="invoices",
            measures=(
                ("SUM", "amount_due", "total invoiced amount"),
                ("AVG", "days_to_pay", "average days to pay"),
                ("COUNT", "*", "number of invoices"),
                ("SUM", "tax_amount", "total tax collected"),
                ("COUNT", "DISTINCT customer_id", "number of paying customers"),
            ),
            dims=("currency", "payment_method", "status"),
            date_col="issued_at",
            filters=(
                ("payment_method", ("card", "bank_transfer", "paypal", "direct_debit")),
                ("currency", ("USD", "EUR", "GBP", "JPY", "SEK")),
                ("status", ("paid", "overdue", "void", "draft")),
            ),
        ),
        joins=(
            _Join("customers", "c", "c.customer_id = {f}.customer_id", ("segment", "country", "industry")),
            _Join("contracts", "ct", "ct.contract_id = {f}.contract_id", ("contract_type", "sales_rep")),
        ),
        insert_cols=("customer_id", "contract_id", "currency", "amount_due", "status", "issued_at"),
    ),
    _Schema(
        fact=_Table(
            name="shipments",
            alias="sh",
            key="shipment_id",
            noun="shipments",
            measures=(
                ("AVG", "transit_days", "average transit time"),
                ("SUM", "weight_kg", "total shipped weight"),
                ("COUNT", "*", "number of shipments"),
                ("SUM", "freight_cost", "total freight cost"),
                ("MAX", "transit_days", "longest transit time"),
            ),
            dims=("carrier", "service_level", "destination_country"),
            date_col="shipped_at",
            filters=(
                ("carrier", ("dhl", "ups", "fedex", "postnl", "dpd", "gls")),
                ("service_level", ("standard", "express", "economy", "same_day")),
            ),
        ),
        joins=(
            _Join("warehouses", "w", "w.warehouse_id = {f}.warehouse_id", ("city", "region")),
            _Join("orders", "o", "o.order_id = {f}.order_id", ("channel", "status")),
        ),
        insert_cols=("order_id", "warehouse_id", "carrier", "service_level", "weight_kg", "shipped_at"),
    ),
    _Schema(
        fact=_Table(
            name="employees",
            alias="e",
            key="employee_id",
            noun="employees",
            measures=(
                ("AVG", "salary", "average salary"),
                ("COUNT", "*", "headcount"),
                ("SUM", "overtime_hours", "total overtime hours"),
                ("AVG", "tenure_years", "average tenure"),
                ("MAX", "salary", "highest salary"),
            ),
            dims=("department", "job_level", "employment_type"),
            date_col="hired_at",
            filters=(
                ("department", ("engineering", "sales", "finance", "support", "legal", "marketing")),
                ("job_level", ("junior", "mid", "senior", "lead", "principal")),
                ("employment_type", ("full_time", "part_time", "contractor")),
            ),
        ),
        joins=(
            _Join("offices", "ofc", "ofc.office_id = {f}.office_id", ("city", "country")),
            _Join("teams", "tm", "tm.team_id = {f}.team_id", ("team_name", "cost_center")),
        ),
        insert_cols=("office_id", "team_id", "department", "job_level", "salary", "hired_at"),
    ),
    _Schema(
        fact=_Table(
            name="ad_events",
            alias="ae",
            key="event_id",
            noun="ad events",
            measures=(
                ("SUM", "spend", "total ad spend"),
                ("SUM", "clicks", "total clicks"),
                ("AVG", "cost_per_click", "average cost per click"),
                ("COUNT", "DISTINCT visitor_id", "number of unique visitors"),
                ("SUM", "conversions", "total conversions"),
            ),
            dims=("platform", "campaign_type", "country"),
            date_col="event_date",
            filters=(
                ("platform", ("google", "meta", "linkedin", "tiktok", "bing")),
                ("campaign_type", ("search", "display", "video", "email", "retargeting")),
            ),
        ),
        joins=(
            _Join("campaigns", "cp", "cp.campaign_id = {f}.campaign_id", ("campaign_name", "objective")),
            _Join("landing_pages", "lp", "lp.page_id = {f}.page_id", ("page_type", "language")),
        ),
        insert_cols=("campaign_id", "page_id", "platform", "spend", "clicks", "event_date"),
    ),
)

_SQL_DECIMALS = frozenset(
    {"total_amount", "amount_due", "tax_amount", "freight_cost", "weight_kg", "salary", "spend", "cost_per_click"}
)
_SQL_VALUES: dict[str, tuple[str, ...]] = {
    "region": ("north", "south", "east", "west", "central", "emea", "apac", "latam"),
    "country": (
        "Germany",
        "France",
        "Japan",
        "Brazil",
        "Canada",
        "India",
        "Spain",
        "Kenya",
        "Sweden",
        "Mexico",
    ),
    "segment": ("enterprise", "smb", "consumer", "public_sector", "startup"),
    "industry": ("retail", "healthcare", "banking", "education", "manufacturing", "media"),
    "city": _CITIES,
    "plan": ("free", "basic", "pro", "team", "enterprise"),
    "tier": ("bronze", "silver", "gold", "platinum"),
    "team": ("tier1", "tier2", "escalations", "billing", "onboarding"),
    "category": ("electronics", "apparel", "grocery", "furniture", "toys", "beauty", "sports"),
    "contract_type": ("annual", "monthly", "multi_year", "pilot"),
    "objective": ("awareness", "leads", "sales", "app_installs"),
    "language": ("en", "de", "fr", "es", "ja", "pt"),
    "channel": ("web", "mobile", "store", "partner", "email", "chat", "phone"),
    "status": _STATUS_VALUES,
    "device": ("desktop", "ios", "android", "tablet"),
    "browser": ("chrome", "firefox", "safari", "edge"),
    "priority": ("low", "medium", "high", "urgent"),
    "billing_period": ("monthly", "yearly"),
    "signup_source": ("organic", "referral", "paid_search", "social", "partner"),
    "page_type": ("pricing", "product", "blog", "signup"),
    "cost_center": ("CC-100", "CC-210", "CC-340", "CC-420", "CC-515"),
}

_SQL_ALIASES = {"SUM": "total", "AVG": "avg", "COUNT": "cnt", "MIN": "min", "MAX": "max"}


def _measure_sql(table: _Table, agg: str, column: str) -> str:
    if column == "*":
        return "COUNT(*)"
    if column.startswith("DISTINCT "):
        return f"COUNT(DISTINCT {table.alias}.{column.split()[1]})"
    return f"{agg}({table.alias}.{column})"


def _measure_alias(agg: str, column: str) -> str:
    if column == "*":
        return "n"
    base = column.split()[-1]
    return f"{_SQL_ALIASES[agg]}_{base}"


def _time_filter(rng: random.Random, table: _Table) -> tuple[str, str]:
    """Return (SQL predicate, comment phrase) restricting the fact table's date column."""
    col = f"{table.alias}.{table.date_col}"
    year = rng.randint(2019, 2025)
    style = rng.randrange(4)
    if style == 0:
        return f"{col} >= '{year}-01-01' AND {col} < '{year + 1}-01-01'", f"in {year}"
    if style == 1:
        month = rng.randint(1, 12)
        start = f"{year}-{month:02d}-01"
        end = f"{year + (month == 12)}-{month % 12 + 1:02d}-01"
        return f"{col} >= '{start}' AND {col} < '{end}'", f"in {_MONTHS[month - 1]} {year}"
    if style == 2:
        days = rng.choice((7, 14, 30, 60, 90, 180, 365))
        return f"{col} >= CURRENT_DATE - INTERVAL '{days} days'", f"over the last {days} days"
    date = _iso_date(rng, year)
    return f"{col} >= '{date}'", f"since {date}"


def _category_filter(rng: random.Random, table: _Table) -> tuple[str, str]:
    column, values = table.filters[rng.randrange(len(table.filters))]
    if rng.random() < 0.3:
        chosen = sorted(rng.sample(values, 2))
        quoted = ", ".join(f"'{v}'" for v in chosen)
        return f"{table.alias}.{column} IN ({quoted})", f"for {column} {chosen[0]} or {chosen[1]}"
    value = _pick(rng, values)
    return f"{table.alias}.{column} = '{value}'", f"for {value} {table.noun}"


def _sql_where(rng: random.Random, table: _Table) -> tuple[list[str], list[str]]:
    predicates, phrases = [], []
    if rng.random() < 0.8:
        predicate, phrase = _time_filter(rng, table)
        predicates.append(predicate)
        phrases.append(phrase)
    if rng.random() < 0.5:
        predicate, phrase = _category_filter(rng, table)
        predicates.append(predicate)
        phrases.insert(0, phrase)
    return predicates, phrases


def _where_clause(predicates: list[str]) -> list[str]:
    if not predicates:
        return []
    return [f"WHERE {predicates[0]}", *(f"  AND {p}" for p in predicates[1:])]


def _sql_group_query(rng: random.Random, schema: _Schema) -> str:
    fact = schema.fact
    agg, column, phrase = fact.measures[rng.randrange(len(fact.measures))]
    alias = _measure_alias(agg, column)
    lines: list[str]
    if rng.random() < 0.6:
        join = schema.joins[rng.randrange(len(schema.joins))]
        dim_col = _pick(rng, join.dims)
        dim = f"{join.alias}.{dim_col}"
        join_kind = "LEFT JOIN" if rng.random() < 0.2 else "JOIN"
        from_lines = [
            f"FROM {fact.name} {fact.alias}",
            f"{join_kind} {join.table} {join.alias} ON {join.on.format(f=fact.alias)}",
        ]
    else:
        join = None
        dim_col = _pick(rng, fact.dims)
        dim = f"{fact.alias}.{dim_col}"
        from_lines = [f"FROM {fact.name} {fact.alias}"]
    predicates, phrases = _sql_where(rng, fact)
    if join is not None and rng.random() < 0.4:
        other = [d for d in join.dims if d != dim_col and d in _SQL_VALUES]
        if other:
            column_name = _pick(rng, other)
            value = _pick(rng, _SQL_VALUES[column_name])
            predicates.append(f"{join.alias}.{column_name} = '{value}'")
            phrases.append(f"for {column_name.replace('_', ' ')} {value}")
    lines = [
        f"SELECT {dim}, {_measure_sql(fact, agg, column)} AS {alias}",
        *from_lines,
        *_where_clause(predicates),
        f"GROUP BY {dim}",
    ]
    if rng.random() < 0.3:
        threshold = rng.randint(2, 500)
        lines.append(f"HAVING {_measure_sql(fact, agg, column)} > {threshold}")
        phrases.append(f"with more than {threshold}")
    direction = _pick(rng, ("DESC", "ASC"))
    lines.append(f"ORDER BY {alias} {direction}")
    if rng.random() < 0.5:
        n = rng.randint(3, 25)
        lines.append(f"LIMIT {n}")
        phrases.append(f"({'top' if direction == 'DESC' else 'bottom'} {n})")
    comment = _sentence_join((f"-- {phrase} per {dim_col.replace('_', ' ')}", *phrases))
    return comment + "\n" + "\n".join(lines) + ";"


def _sql_top_rows(rng: random.Random, schema: _Schema) -> str:
    fact = schema.fact
    numeric = [c for agg, c, _ in fact.measures if c != "*" and not c.startswith("DISTINCT")]
    column = _pick(rng, numeric) if numeric else fact.key
    n = rng.randint(5, 100)
    threshold = rng.randint(1, 2000)
    extra = rng.sample(fact.dims, min(len(fact.dims), rng.randint(1, 2)))
    cols = ", ".join(f"{fact.alias}.{c}" for c in (fact.key, *extra, column))
    predicates, phrases = _sql_where(rng, fact)
    predicates.insert(0, f"{fact.alias}.{column} > {threshold}")
    lines = [
        f"SELECT {cols}",
        f"FROM {fact.name} {fact.alias}",
        *_where_clause(predicates),
        f"ORDER BY {fact.alias}.{column} DESC",
        f"LIMIT {n};",
    ]
    label = column.replace("_", " ")
    comment = _sentence_join((f"-- {n} {fact.noun} with the highest {label} above {threshold}", *phrases))
    return comment + "\n" + "\n".join(lines)


def _sql_cte(rng: random.Random, schema: _Schema) -> str:
    fact = schema.fact
    agg, column, phrase = fact.measures[rng.randrange(len(fact.measures))]
    grain = _pick(rng, ("month", "week", "day", "quarter"))
    name = _pick(rng, (f"{grain}ly", "per_period", "buckets", "agg", f"{fact.name}_by_{grain}"))
    name = name.replace("dayly", "daily")
    predicates, phrases = _sql_where(rng, fact)
    inner = [
        f"    SELECT DATE_TRUNC('{grain}', {fact.alias}.{fact.date_col}) AS period,",
        f"           {_measure_sql(fact, agg, column)} AS value",
        f"    FROM {fact.name} {fact.alias}",
        *("    " + w for w in _where_clause(predicates)),
        "    GROUP BY 1",
    ]
    tail = _pick(rng, ("value", "period", "change"))
    if tail == "change":
        outer = [
            "SELECT period, value,",
            "       value - LAG(value) OVER (ORDER BY period) AS change",
            f"FROM {name}",
            "ORDER BY period;",
        ]
        what = f"{grain}-over-{grain} change in {phrase}"
    else:
        outer = ["SELECT period, value", f"FROM {name}", f"ORDER BY {tail} {_pick(rng, ('DESC', 'ASC'))};"]
        what = f"{phrase} per {grain}"
    comment = f"-- {what} {' '.join(phrases)}".rstrip()
    return "\n".join([comment, f"WITH {name} AS (", *inner, ")", *outer])


def _sql_literal(rng: random.Random, column: str, table: _Table) -> str:
    if column.endswith(("_at", "_date")):
        return f"'{_iso_date(rng, rng.randint(2022, 2025))}'"
    if column.endswith("_id"):
        return str(rng.randint(1, 99999))
    if column == "sku":
        return f"'SKU-{rng.randint(10000, 99999)}'"
    if column in _SQL_DECIMALS:
        return f"{rng.uniform(1, 3000):.2f}"
    options = dict(table.filters).get(column) or _SQL_VALUES.get(column)
    if options is None:
        return str(rng.randint(1, 5000))
    return "'" + _pick(rng, options).replace("'", "''") + "'"


def _sql_insert(rng: random.Random, schema: _Schema) -> str:
    cols = schema.insert_cols
    rows = [", ".join(_sql_literal(rng, c, schema.fact) for c in cols) for _ in range(rng.randint(1, 3))]
    values = ",\n       ".join(f"({row})" for row in rows)
    plural = "rows" if len(rows) > 1 else "row"
    verb = _pick(rng, ("add", "insert", "record", "load"))
    comment = f"-- {verb} {len(rows)} new {plural} into {schema.fact.name}"
    return f"{comment}\nINSERT INTO {schema.fact.name} ({', '.join(cols)})\nVALUES {values};"


def _sql_update(rng: random.Random, schema: _Schema) -> str:
    fact = schema.fact
    column, values = fact.filters[rng.randrange(len(fact.filters))]
    new_value = _pick(rng, values)
    if rng.random() < 0.5:
        key_value = _sql_literal(rng, fact.key, fact)
        where, what = f"{fact.key} = {key_value}", f"{fact.key.replace('_', ' ')} {key_value}"
    else:
        date = _iso_date(rng, rng.randint(2020, 2025))
        where, what = f"{fact.date_col} < '{date}'", f"{fact.noun} older than {date}"
    comment = f"-- set {column} to {new_value} for {what}"
    return f"{comment}\nUPDATE {fact.name}\nSET {column} = '{new_value}'\nWHERE {where};"


_SQL_BUILDERS: tuple[tuple[Callable[[random.Random, _Schema], str], float], ...] = (
    (_sql_group_query, 0.42),
    (_sql_top_rows, 0.2),
    (_sql_cte, 0.2),
    (_sql_insert, 0.09),
    (_sql_update, 0.09),
)


def _sql_statement(rng: random.Random, schema: _Schema) -> str:
    roll = rng.random()
    for builder, weight in _SQL_BUILDERS:
        if roll < weight:
            return builder(rng, schema)
        roll -= weight
    return _sql_group_query(rng, schema)


def _sql(rng: random.Random) -> str:
    schema = _SCHEMAS[rng.randrange(len(_SCHEMAS))]
    statements: list[str] = []
    target = rng.choice((1, 2, 2, 3))
    while len(statements) < target or sum(len(s) + 2 for s in statements) < MIN_CHARS:
        statements.append(_sql_statement(rng, schema))
    return "\n\n".join(statements) + "\n"


def _sql_prompt(rng: random.Random) -> str:
    sample = _sql(rng)
    while sample.index("\n") > 110:  # keep prompts short: redraw the rare over-long question
        sample = _sql(rng)
    comment_end = sample.index("\n") + 1
    keyword = sample[comment_end:].split(None, 1)[0]
    if rng.random() < 0.6:
        return sample[: comment_end + len(keyword)]
    return sample[:comment_end]


# --------------------------------------------------------------------------------------------------
# doc_summary
# --------------------------------------------------------------------------------------------------

_FEATURES = (
    "longer battery life",
    "offline mode",
    "a redesigned dashboard",
    "faster sync",
    "voice control",
    "end-to-end encryption",
    "a lighter frame",
    "multi-user profiles",
    "automatic backups",
    "dark mode",
    "improved noise cancelling",
    "a recycled aluminium case",
    "single sign-on",
    "usage reports",
)
_ROOT_CAUSES = (
    "an expired TLS certificate",
    "a misconfigured load balancer",
    "a database failover that stalled",
    "a bad configuration push",
    "disk exhaustion on a cache node",
    "a memory leak in the API gateway",
    "a faulty network switch",
    "a runaway batch job",
    "a DNS change",
    "a dependency upgrade",
)
_SERVICES = (
    "checkout API",
    "login service",
    "search cluster",
    "payments gateway",
    "notification service",
    "mobile backend",
    "reporting pipeline",
    "inventory sync",
    "video transcoder",
    "customer portal",
)
_DECISIONS = (
    "approved a budget of {money} for the {team} roadmap",
    "agreed to hire {count} engineers",
    "postponed the office move to {date2}",
    "selected {vendor} as the new cloud vendor",
    "set a target of {pct}% customer retention",
    "decided to sunset the legacy {service}",
)
_FILLERS = (
    "Several attendees asked for more detail on the timeline.",
    "The figures are preliminary and may be revised.",
    "Feedback from early customers was broadly positive.",
    "The team will share a more detailed update next month.",
    "No changes to pricing are planned for the rest of the year.",
    "A recording is available on the internal portal.",
    "Questions can be sent to the project mailbox.",
    "The board will review progress at its next meeting.",
)


def _doc_facts(rng: random.Random) -> dict[str, str]:
    symbol = _pick(rng, _CURRENCY_SYMBOLS)
    year = rng.randint(2019, 2025)
    return {
        "company": _pick(rng, _COMPANIES),
        "person": _full_name(rng),
        "person2": _full_name(rng),
        "vendor": _pick(rng, _COMPANIES),
        "quarter": f"Q{rng.randint(1, 4)}",
        "year": str(year),
        "revenue": f"{symbol}{rng.uniform(1.5, 950):.1f} million",
        "money": _money(rng, symbol, 20_000, 4_000_000),
        "growth": f"{rng.uniform(0.5, 38):.1f}",
        "margin": f"{rng.uniform(4, 45):.1f}",
        "pct": str(rng.randint(55, 99)),
        "count": str(rng.randint(2, 40)),
        "headcount": f"{rng.randint(40, 12000):,}",
        "region": _pick(rng, _REGIONS),
        "team": _pick(rng, _TEAMS),
        "date": _date(rng, year),
        "date2": _date(rng, year),
        "weekday": _pick(rng, _WEEKDAYS),
        "city": _pick(rng, _CITIES),
        "product": _product(rng),
        "price": _money(rng, symbol, 19, 2500),
        "units": f"{rng.randint(500, 250_000):,}",
        "feature": _pick(rng, _FEATURES),
        "feature2": _pick(rng, _FEATURES),
        "service": _pick(rng, _SERVICES),
        "minutes": str(rng.randint(7, 540)),
        "users_pct": str(rng.randint(1, 80)),
        "cause": _pick(rng, _ROOT_CAUSES),
        "time": f"{rng.randint(0, 23):02d}:{rng.choice(('00', '05', '15', '20', '30', '45', '50'))} UTC",
        "tickets": str(rng.randint(12, 4000)),
        "attendees": str(rng.randint(4, 60)),
        "bids": str(rng.randint(2, 9)),
    }


@dataclass(frozen=True)
class _DocKind:
    """A document type: a fixed headline, optional body sentences in order, and summary templates."""

    headlines: tuple[str, ...]
    body: tuple[str, ...]
    summaries: tuple[str, ...]


_DOC_KINDS: tuple[_DocKind, ...] = (
    _DocKind(
        headlines=(
            "{company} reported revenue of {revenue} for {quarter} {year}, up {growth}% from a year earlier.",
            "In its {quarter} {year} results, {company} posted {revenue} in revenue, a {growth}% increase.",
        ),
        body=(
            "Growth was strongest in {region}, where sales of the {product} doubled.",
            "Operating margin came in at {margin}%, according to chief financial officer {person}.",
            "The company now employs {headcount} people across {count} offices.",
            "{person} said the results reflected disciplined cost control and steady demand.",
            "Marketing spend for the quarter totalled {money}.",
            "Revenue from the {product} line reached {money}, led by customers in {city}.",
            "{count} new stores opened in {region} during the period.",
            "Management expects margins to stay near {margin}% in the next quarter.",
            "The report was published on {date}.",
        ),
        summaries=(
            "{company} earned {revenue} in {quarter} {year}, {growth}% more than last year.",
            "{company}'s {quarter} {year} revenue rose {growth}% to {revenue}, with strongest growth in {region}.",
            "Revenue at {company} grew {growth}% to {revenue} in {quarter} {year}; margin was {margin}%.",
            "{company} ({headcount} employees) reported {revenue} for {quarter} {year}.",
            "CFO {person} reported a {margin}% operating margin for {company} in {quarter} {year}.",
        ),
    ),
    _DocKind(
        headlines=(
            "On {date}, the {team} team met in {city} to plan the next release, chaired by {person}.",
            "The {team} team held its quarterly planning meeting on {date}, led by {person}.",
        ),
        body=(
            "{attendees} people attended, including {person2} from finance.",
            "The group " + _DECISIONS[0] + ".",
            "Participants " + _DECISIONS[1] + " before {date2}.",
            "After a long discussion the team " + _DECISIONS[4] + ".",
            "{person2} will own the action items and report back on {date2}.",
            "It was also noted that the team " + _DECISIONS[2] + ".",
            "Finally, the group " + _DECISIONS[3] + " after comparing {bids} bids.",
            "The meeting also " + _DECISIONS[5] + " by the end of {year}.",
            "The next session is scheduled for a {weekday} in {city}.",
        ),
        summaries=(
            "At the {date} meeting chaired by {person}, the {team} team agreed on next steps; {person2} "
            "owns the follow-up.",
            "The {team} team met on {date} under {person} with {attendees} attendees and set its release plan.",
            "{person} led the {team} planning meeting on {date}, where decisions were assigned to {person2}.",
            "{person} chaired the {team} team's planning meeting on {date}.",
            "On {date} the {team} team, led by {person}, agreed to hire {count} engineers.",
            "The {team} team met on {date} and set a {pct}% customer retention target.",
        ),
    ),
    _DocKind(
        headlines=(
            "{company} launched the {product} on {date} at a price of {price}.",
            "On {date}, {company} unveiled the {product}, priced at {price}.",
        ),
        body=(
            "The new model adds {feature} and {feature2}.",
            "More than {units} units were pre-ordered in the first week.",
            "It will be available in {region} first, followed by other markets later in {year}.",
            "Product lead {person} described it as the most requested upgrade in years.",
            "Early units ship from the {city} factory on {date2}.",
            "A cheaper version without {feature2} is planned for {year}.",
            "Reviewers in {city} praised the {feature}.",
            "The launch event drew {attendees} journalists.",
            "{company} expects the product to contribute {revenue} in sales this year.",
        ),
        summaries=(
            "{company} released the {product} on {date} for {price}, with {feature} and strong pre-orders.",
            "The {product} from {company} launched on {date} at {price}; product lead {person} called it a "
            "major upgrade.",
            "{company} launched the {product} at {price} on {date}, starting in {region}.",
            "{company} launched the {product} on {date} at {price}.",
            "The {product} ({price}) went on sale on {date} with {units} pre-orders.",
        ),
    ),
    _DocKind(
        headlines=(
            "On {date} at {time}, the {service} at {company} suffered an outage lasting {minutes} minutes.",
            "An incident on {date} took the {service} offline for {minutes} minutes starting at {time}.",
        ),
        body=(
            "About {users_pct}% of users were unable to complete requests.",
            "The root cause was {cause}.",
            "On-call engineer {person} restored service by rolling back the change.",
            "Support received {tickets} tickets during the incident.",
            "Customers in {region} were hit hardest, with error rates peaking on the {weekday} evening.",
            "The team estimates the outage cost about {money} in lost sales.",
            "{person2} will lead the post-incident review on {date2}.",
            "Monitoring has been extended to alert on similar conditions.",
            "No customer data was lost.",
        ),
        summaries=(
            "The {service} was down for {minutes} minutes on {date} because of {cause}; {person} restored it.",
            "A {minutes}-minute outage of the {service} on {date} affected {users_pct}% of users.",
            "On {date} the {service} failed for {minutes} minutes due to {cause}, generating {tickets} tickets.",
            "On {date} the {service} was unavailable for {minutes} minutes from {time}.",
            "A {minutes}-minute {service} outage on {date} was caused by {cause}.",
        ),
    ),
    _DocKind(
        headlines=(
            "{company} announced a partnership with {vendor} on {date} to expand in {region}.",
            "On {date}, {company} and {vendor} signed a {year} partnership covering {region}.",
        ),
        body=(
            "The agreement is worth {money} over {count} years.",
            "{person}, head of partnerships at {company}, negotiated the deal.",
            "{vendor} will supply the {product} to {units} customers.",
            "Both companies will open a joint office in {city} on {date2}.",
            "Analysts expect the deal to lift revenue by {growth}%.",
            "The first joint campaign focuses on {feature}.",
            "{person2} from {vendor} will lead the integration team.",
        ),
        summaries=(
            "{company} partnered with {vendor} on {date} to grow in {region}.",
            "{company} and {vendor} signed a deal on {date} worth {money}.",
            "{person} closed a {region} partnership between {company} and {vendor} on {date}.",
            "The {company}-{vendor} partnership announced on {date} targets {region} and {units} customers.",
        ),
    ),
    _DocKind(
        headlines=(
            "A customer survey run by {company} in {quarter} {year} collected {tickets} responses.",
            "{company} published its {quarter} {year} customer survey with {tickets} responses.",
        ),
        body=(
            "{pct}% of respondents said they would recommend the {product}.",
            "The most requested improvement was {feature}.",
            "Satisfaction was highest in {region} and lowest among customers in {city}.",
            "Research lead {person} presented the findings on {date}.",
            "Complaints about delivery times fell by {growth}% compared with the previous survey.",
            "The {team} team will act on the results before {date2}.",
            "{users_pct}% of respondents had contacted support in the last month.",
        ),
        summaries=(
            "{company}'s {quarter} {year} survey gathered {tickets} responses.",
            "In {company}'s {quarter} {year} survey, {pct}% would recommend the {product}.",
            "{person} presented {company}'s survey of {tickets} customers on {date}; {feature} topped the wish list.",
        ),
    ),
)


def _fields(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def _doc_sentences(rng: random.Random, kind: _DocKind) -> list[str]:
    """Pick the headline, 3--6 body sentences in their natural order and maybe a filler (4--8 total)."""
    n_body = rng.randint(3, 6)
    chosen = sorted(rng.sample(range(len(kind.body)), min(n_body, len(kind.body))))
    sentences = [_pick(rng, kind.headlines)] + [kind.body[i] for i in chosen]
    if rng.random() < 0.4:
        sentences.insert(rng.randint(2, len(sentences)), _pick(rng, _FILLERS))
    return sentences[:8]


def _doc_summary_parts(rng: random.Random) -> tuple[str, str]:
    """Return (paragraph, summary); the summary only mentions facts that the paragraph states."""
    kind = _DOC_KINDS[rng.randrange(len(_DOC_KINDS))]
    facts = _doc_facts(rng)
    sentences = _doc_sentences(rng, kind)
    stated = set().union(*(_fields(sentence) for sentence in sentences))
    usable = [t for t in kind.summaries if _fields(t) <= stated]
    rng.shuffle(usable)
    chosen = usable[: 2 if rng.random() < 0.3 else 1]
    paragraph = " ".join(sentences).format(**facts)
    summary = " ".join(chosen).format(**facts)
    return paragraph, summary


def _doc_summary(rng: random.Random) -> str:
    paragraph, summary = _doc_summary_parts(rng)
    return f"Document:\n{paragraph}\n\nSummary:\n{summary}\n"


def _doc_summary_prompt(rng: random.Random) -> str:
    paragraph, _ = _doc_summary_parts(rng)
    return f"Document:\n{paragraph}\n\nSummary:\n"


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------

_SAMPLERS: dict[str, Callable[[random.Random], str]] = {
    "customer_service": _customer_service,
    "code": _code,
    "sql": _sql,
    "doc_summary": _doc_summary,
}
_PROMPTERS: dict[str, Callable[[random.Random], str]] = {
    "customer_service": _customer_service_prompt,
    "code": _code_prompt,
    "sql": _sql_prompt,
    "doc_summary": _doc_summary_prompt,
}


def _check_args(domain: str, count: int) -> None:
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}; valid domains are: {', '.join(DOMAINS)}")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"count must be a non-negative integer, got count={count!r}")


def _bounded_sample(rng: random.Random, sampler: Callable[[random.Random], str]) -> str:
    """Draw samples until one is MIN_CHARS..MAX_CHARS long (deterministic given ``rng``)."""
    text = sampler(rng)
    for _ in range(_MAX_ATTEMPTS):
        if MIN_CHARS <= len(text) <= MAX_CHARS:
            return text
        text = sampler(rng)
    raise RuntimeError("could not draw a sample within the length bounds")  # pragma: no cover


def generate(domain: str, count: int, seed: int) -> list[str]:
    """Return ``count`` synthetic samples of ``domain``, deterministic in ``(domain, seed)``.

    ``generate(d, n, s)`` is a prefix of ``generate(d, m, s)`` for ``n <= m``; different seeds give
    different samples, so held-out sets are drawn with another seed.
    """
    _check_args(domain, count)
    rng = random.Random(f"{domain}:{seed}")
    sampler = _SAMPLERS[domain]
    return [_bounded_sample(rng, sampler) for _ in range(count)]


def generate_mixed(count: int, seed: int) -> list[tuple[str, str]]:
    """Return ``count`` ``(domain, text)`` pairs, domains interleaved round-robin in a seeded order.

    The texts of each domain are exactly ``generate(domain, k, seed)`` for that domain's share ``k``.
    """
    _check_args(DOMAINS[0], count)
    order = list(DOMAINS)
    random.Random(f"mixed:{seed}").shuffle(order)
    shares = {domain: len(range(i, count, len(order))) for i, domain in enumerate(order)}
    texts = {domain: iter(generate(domain, shares[domain], seed)) for domain in order}
    return [(order[i % len(order)], next(texts[order[i % len(order)]])) for i in range(count)]


def prompts(domain: str, count: int, seed: int) -> list[str]:
    """Return ``count`` short in-domain prompt prefixes: the opening of a fresh sample, cut naturally.

    * ``customer_service``: ``<|user|>\\n{first user message}\\n<|assistant|>\\n``;
    * ``code``: e.g. ``def parse_invoice(``, an import block plus ``def name(``, or a signature plus
      the start of its docstring;
    * ``sql``: the question comment line plus the first keyword (``SELECT``/``WITH``/...), or the
      comment line alone;
    * ``doc_summary``: ``Document:\\n{paragraph}\\n\\nSummary:\\n``.
    """
    _check_args(domain, count)
    rng = random.Random(f"prompt:{domain}:{seed}")
    prompter = _PROMPTERS[domain]
    return [prompter(rng) for _ in range(count)]
