"""The profile set: a user's facts told over weeks, most unrelated to each other, some revised later.

Forty facts, fifteen of them revised (a new job, a moved appointment, a diet that changed) and
the rest never (an allergy, a sister's name). Each fact has a question, in the third person and
in the first, and a statement, in both persons. Four users tell them, each in one form:

- `maya`: third-person facts (`kind="semantic"`), as an extractor or an agent's notes would hold;
- `tom`: first-person messages, one a day, no replies;
- `lena`: a chat, her messages and the assistant's replies, both roles stored;
- `raj`: a chat too, the facts in another order.

Unrelated facts are told all along the weeks, the originals of revised facts in the first half
and their revisions in the second: so a newer, unrelated statement often sits near an older
fact in time and in meaning ("I'm allergic to peanuts", later "My sister is called Ines", asked
"What food is dangerous for me?"). A question's evidence is the statement that holds now (the
revision, for a revised fact); newer-first compares a revision with its original.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from engram import Memory


@dataclass(frozen=True)
class Fact:
    ask: str        # the question, third person
    ask_me: str     # ... first person
    said: str       # the statement, third person
    said_me: str    # ... first person
    revised: str | None = None
    revised_me: str | None = None


FACTS = (
    Fact("What food is dangerous for the user?", "What food is dangerous for me?",
         "The user is allergic to peanuts.", "I'm allergic to peanuts."),
    Fact("What is the name of the user's sister?", "What's my sister called?",
         "The user's sister is called Ines.", "My sister is called Ines."),
    Fact("Where does the user live?", "Where do I live?",
         "The user lives in Porto.", "I live in Porto, near the river.",
         "The user moved to Lisbon.", "I moved to Lisbon last week."),
    Fact("What does the user do for work?", "What do I do for work?",
         "The user works as a nurse at Santa Maria hospital.",
         "I work as a nurse at Santa Maria hospital.",
         "The user now works as a paramedic for the fire brigade.",
         "I left the hospital, I'm a paramedic with the fire brigade now."),
    Fact("What pet does the user have?", "What pet do I have?",
         "The user has a cat named Luna.", "I have a cat named Luna."),
    Fact("What diet does the user follow?", "What diet do I follow?",
         "The user is vegetarian.", "I'm vegetarian.",
         "The user eats fish again and is pescatarian.",
         "I've started eating fish again, so I'm pescatarian."),
    Fact("What car does the user drive?", "What car do I drive?",
         "The user drives an old Toyota Corolla.", "I drive an old Toyota Corolla.",
         "The user drives an electric Renault Zoe.", "I drive an electric Renault Zoe."),
    Fact("When is the user's birthday?", "When is my birthday?",
         "The user's birthday is on March 14.", "My birthday is on March 14."),
    Fact("Which football team does the user support?", "Which football team do I support?",
         "The user supports Benfica.", "I support Benfica."),
    Fact("Which language is the user learning?", "Which language am I learning?",
         "The user is learning Japanese.", "I'm learning Japanese on Duolingo.",
         "The user dropped Japanese and is learning Korean.",
         "I gave up on Japanese, I'm learning Korean instead."),
    Fact("How does the user take their coffee?", "How do I take my coffee?",
         "The user takes coffee black with no sugar.", "I take my coffee black, no sugar.",
         "The user takes coffee with oat milk.", "These days I take my coffee with oat milk."),
    Fact("What is the name of the user's partner?", "What's my partner's name?",
         "The user's partner is called Miguel.", "My partner is called Miguel."),
    Fact("What exercise does the user do?", "What exercise do I do?",
         "The user goes running three times a week.", "I go running three times a week.",
         "The user swims twice a week after a knee injury.",
         "After my knee injury I switched from running to swimming twice a week."),
    Fact("What is the user's favourite book?", "What's my favourite book?",
         "The user's favourite book is One Hundred Years of Solitude.",
         "My favourite book is One Hundred Years of Solitude."),
    Fact("Which phone does the user have?", "Which phone do I have?",
         "The user has an iPhone 12.", "I have an iPhone 12.",
         "The user has a Pixel 8.", "I replaced my iPhone with a Pixel 8."),
    Fact("What instrument does the user play?", "What instrument do I play?",
         "The user plays the cello.", "I play the cello in an amateur orchestra."),
    Fact("What medication does the user take?", "What medication do I take?",
         "The user takes levothyroxine every morning.",
         "I take levothyroxine every morning for my thyroid."),
    Fact("What is the user afraid of?", "What am I afraid of?",
         "The user is afraid of heights.", "I'm terrified of heights."),
    Fact("How does the user get to work?", "How do I get to work?",
         "The user commutes to work by bike.", "I cycle to work every day.",
         "The user takes the metro to work.", "Since the move I take the metro to work."),
    Fact("Where did the user grow up?", "Where did I grow up?",
         "The user grew up in Braga.", "I grew up in Braga."),
    Fact("How many children does the user have?", "How many kids do I have?",
         "The user has two daughters, Sofia and Clara.", "I have two daughters, Sofia and Clara."),
    Fact("What cuisine does the user like best?", "What's my favourite cuisine?",
         "The user loves Thai food.", "Thai food is my favourite."),
    Fact("What does the user do on weekends?", "What do I do on weekends?",
         "The user spends weekends hiking in the mountains.",
         "On weekends I go hiking in the mountains."),
    Fact("What series is the user watching?", "What series am I watching?",
         "The user is watching The Bear.", "I'm watching The Bear at the moment.",
         "The user finished The Bear and is watching Severance.",
         "I finished The Bear, now I'm watching Severance."),
    Fact("Which operating system does the user use?", "Which operating system do I use?",
         "The user uses Linux on a ThinkPad.", "I use Linux on my ThinkPad."),
    Fact("What is the user's blood type?", "What's my blood type?",
         "The user's blood type is O negative.", "My blood type is O negative."),
    Fact("How much rent does the user pay?", "How much is my rent?",
         "The user pays 900 euros a month in rent.", "My rent is 900 euros a month.",
         "The user's rent went up to 1,050 euros a month.",
         "My landlord raised the rent to 1,050 euros a month."),
    Fact("Where does the user's mother live?", "Where does my mother live?",
         "The user's mother lives in Coimbra.", "My mom lives in Coimbra."),
    Fact("When is the user's dentist appointment?", "When is my dentist appointment?",
         "The user has a dentist appointment on June 3.", "I have a dentist appointment on June 3.",
         "The user's dentist appointment moved to June 10.",
         "The dentist rescheduled my appointment to June 10."),
    Fact("What is the user's favourite colour?", "What's my favourite colour?",
         "The user's favourite colour is green.", "My favourite colour is green."),
    Fact("Where does the user volunteer?", "Where do I volunteer?",
         "The user volunteers at an animal shelter on Saturdays.",
         "I volunteer at the animal shelter on Saturdays."),
    Fact("What time does the user go to bed?", "What time do I go to bed?",
         "The user goes to bed around 11 pm.", "I usually go to bed around 11."),
    Fact("Where is the user going on holiday?", "Where am I going on holiday?",
         "The user is going to Iceland on holiday in July.",
         "I'm going to Iceland in July for my holidays.",
         "The user cancelled Iceland and is going to Sardinia in July.",
         "We cancelled Iceland; we're going to Sardinia in July instead."),
    Fact("What did the user study?", "What did I study?",
         "The user studied chemistry at university.", "I studied chemistry at university."),
    Fact("Which medicine must the user never be given?", "Which medicine must I never take?",
         "The user is allergic to penicillin.", "I'm allergic to penicillin."),
    Fact("What is the user's shoe size?", "What's my shoe size?",
         "The user wears shoe size 39.", "I wear size 39 shoes."),
    Fact("What is the user's favourite wine?", "What's my favourite wine?",
         "The user's favourite wine is Alvarinho.", "My favourite wine is Alvarinho."),
    Fact("Who is the user's manager?", "Who is my manager?",
         "The user's manager is Carla.", "My manager is Carla.",
         "The user's new manager is Pedro.", "Carla left, so Pedro is my manager now."),
    Fact("Which gym is the user a member of?", "Which gym am I a member of?",
         "The user is a member of the Holmes Place gym.", "I'm a member of Holmes Place.",
         "The user cancelled Holmes Place and joined the Fitness Hut gym.",
         "I cancelled my Holmes Place membership and joined Fitness Hut."),
    Fact("What podcast does the user listen to?", "What podcast do I listen to?",
         "The user listens to the Hardcore History podcast.",
         "I listen to Hardcore History on my commute."),
)

REPLIES = ("Thanks, I'll remember that.", "Noted!", "Good to know, I'll keep it in mind.",
           "Got it. Anything else I should know?", "Okay, noted for later.")
START = datetime(2025, 1, 6, 9, 0, tzinfo=UTC)


@dataclass(frozen=True)
class User:
    name: str
    form: str  # "facts" | "statements" | "chat"
    seed: int | None  # the facts' order: as listed, or shuffled with this seed


USERS = (User("maya", "facts", None), User("tom", "statements", 1),
         User("lena", "chat", None), User("raj", "chat", 2))


def timeline(user: User) -> list[tuple[int, int, bool]]:
    """(day, fact number, is the revision) of everything the user tells, in the order told:
    unrelated facts over days 1-100, originals of revised facts over 1-45, revisions 55-100."""
    order = list(range(len(FACTS)))
    if user.seed is not None:
        random.Random(user.seed).shuffle(order)
    revised = [i for i in order if FACTS[i].revised]
    plain = [i for i in order if not FACTS[i].revised]
    told = [(1 + 99 * j // len(plain), i, False) for j, i in enumerate(plain)]
    told += [(1 + 44 * j // len(revised), i, False) for j, i in enumerate(revised)]
    told += [(55 + 45 * j // len(revised), i, True) for j, i in enumerate(revised)]
    return sorted(told)


def mid(user: User, fact: int, revision: bool) -> str:
    return f"{user.name}:{fact}{'r' if revision else ''}"


def ingest(mem: Memory, user: User) -> int:
    n = 0
    by_day: dict[int, list[tuple[int, bool]]] = {}
    for day, i, rev in timeline(user):
        by_day.setdefault(day, []).append((i, rev))
    for day, told in by_day.items():
        at = START + timedelta(days=day)
        if user.form == "facts":
            for k, (i, rev) in enumerate(told):
                f = FACTS[i]
                text = f.revised if rev else f.said
                mem.add(text, kind="semantic", user_id=user.name,
                        observed_at=at + timedelta(minutes=k), metadata={"mid": mid(user, i, rev)})
                n += 1
            continue
        messages = []
        for k, (i, rev) in enumerate(told):
            f = FACTS[i]
            messages.append({"role": "user", "content": (f.revised_me if rev else f.said_me),
                             "observed_at": at + timedelta(minutes=2 * k),
                             "metadata": {"mid": mid(user, i, rev)}})
            if user.form == "chat":
                messages.append({"role": "assistant", "content": REPLIES[(day + k) % len(REPLIES)],
                                 "observed_at": at + timedelta(minutes=2 * k + 1),
                                 "metadata": {"mid": f"{user.name}:reply"}})
        mem.add(messages, user_id=user.name, session_id=f"day-{day}", infer=False)
        n += len(messages)
    return n


def questions(user: User) -> Iterator[tuple[str, str, list[str], list[str], list[str], str]]:
    """(user_id, question, evidence, older, newer, category) per fact: "revised" ones ask
    for what holds now, "unrelated" ones for a fact no other statement revises."""
    for i, f in enumerate(FACTS):
        q = f.ask if user.form == "facts" else f.ask_me
        if f.revised:
            new, old = mid(user, i, True), mid(user, i, False)
            yield user.name, q, [new], [old], [new], "revised"
        else:
            yield user.name, q, [mid(user, i, False)], [], [], "unrelated"
