"""The shipped conversation corpus (`agents/conversations/*.jsonl`) and how it was built.

Each conversation is written here as text plus a timing model, and `python -m voicebus.agents.corpus`
regenerates the JSONL files deterministically (seeded): tokens are LLM-like word pieces
(`voicebus.agents.tokens.split_like_llm`), the first token comes after a model-like time to first token
(250-450 ms) and each next one 20-60 ms later. Tests check that the shipped files parse and match
what this module builds, so the texts below are the corpus's source of truth.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from voicebus.agents.conversation_file import Conversation, ControlLine, ConversationEvent, TextLine, save
from voicebus.agents.sdk import END_OF_TURN, EVIDENCE_FAILED, EVIDENCE_PENDING, EVIDENCE_READY, TOKEN
from voicebus.agents.tokens import split_like_llm
from voicebus.schemas.contract import ControlAction

CORPUS_DIR = Path(str(resources.files("voicebus.agents"))) / "conversations"


@dataclass
class _Clock:
    rng: random.Random
    t_ms: float = 0.0

    def first_token(self) -> float:
        self.t_ms += self.rng.uniform(250, 450)
        return self.t_ms

    def next_token(self) -> float:
        self.t_ms += self.rng.uniform(20, 60)
        return self.t_ms

    def wait(self, ms: float) -> float:
        self.t_ms += ms
        return self.t_ms


@dataclass
class _TurnWriter:
    """Appends one speaking agent's turn to `events`: tokens at LLM pace, evidence marks inline."""

    events: list[ConversationEvent]
    clock: _Clock
    session_id: str
    turn_id: str
    agent_id: str = "assistant"
    language: str | None = "en"
    voice: str | None = "af_heart"
    started: bool = field(default=False)

    def _line(self, t_ms: float, kind: str, text: str = "", claim_id: str | None = None) -> None:
        self.events.append(TextLine(t_ms, self.agent_id, self.session_id, self.turn_id, kind, text, claim_id,
                                    self.language, self.voice))

    def _tick(self) -> float:
        if not self.started:
            self.started = True
            return self.clock.first_token()
        return self.clock.next_token()

    def say(self, text: str) -> None:
        for piece in split_like_llm(text):
            self._line(self._tick(), TOKEN, piece)

    def pending(self, claim_id: str) -> None:
        self._line(self._tick(), EVIDENCE_PENDING, claim_id=claim_id)

    def end(self) -> None:
        self._line(self.clock.next_token(), END_OF_TURN)


def _support() -> Conversation:
    events: list[ConversationEvent] = []
    turn = _TurnWriter(events, _Clock(random.Random(1)), "support-1", "t1")
    turn.say(
        "I'm sorry you're locked out of your account. To reset your password, open the sign-in page and "
        "choose \"Forgot password\". We'll email you a link that stays valid for thirty minutes. "
        "If the email doesn't arrive within a few minutes, check your spam folder or ask me to send it again."
    )
    turn.end()
    return Conversation(events, "Support answer",
                        "A customer-support answer of four sentences from one agent (English, af_heart).")


def _rag_slow_retrieval() -> Conversation:
    events: list[ConversationEvent] = []
    clock = _Clock(random.Random(2))
    turn = _TurnWriter(events, clock, "rag-1", "t1")
    turn.say("Let me check your plan.")
    turn.pending("c1")
    t_c1 = clock.t_ms
    turn.say(" Your Business plan includes two terabytes of shared storage per team.")
    turn.pending("c2")
    t_c2 = clock.t_ms
    turn.say(" Files in the trash are kept for ninety days before they're deleted for good.")
    turn.pending("c3")
    t_c3 = clock.t_ms
    turn.say(" Priority phone support is available around the clock.")
    turn.say(" Is there anything else you'd like to know about your plan?")
    turn.end()
    # The retrieval agent resolves the claims from its own topic: c2 quickly, c1 slowly (after the
    # speaker already ended), c3 not at all (the source could not be found).
    retrieval = [
        (t_c2 + 180.0, EVIDENCE_READY, "c2"),
        (t_c3 + 900.0, EVIDENCE_FAILED, "c3"),
        (t_c1 + 3200.0, EVIDENCE_READY, "c1"),
    ]
    for t_ms, kind, claim in retrieval:
        events.append(TextLine(t_ms, "retrieval", "rag-1", "t1", kind, "", claim, None, None))
    events.sort(key=lambda e: e.t_ms)
    return Conversation(
        events, "RAG answer with a slow retrieval",
        "The assistant marks three claims pending as it speaks; a second agent, retrieval, resolves "
        "c2 after 180 ms, fails c3, and confirms c1 3.2 s after it was marked, after the end of the turn.",
    )


def _markdown_long() -> Conversation:
    events: list[ConversationEvent] = []
    turn = _TurnWriter(events, _Clock(random.Random(3)), "markdown-1", "t1")
    turn.say(
        "## How Kafka keeps your messages in order\n\n"
        "Kafka guarantees order **within a partition**, not across a whole topic. "
        "That's why voicebus keys every event by its session id: all of a session's events land in the "
        "same partition, so they're read back in the order they were written.\n\n"
        "### What you need to know\n\n"
        "- A *producer* picks the partition by hashing the key.\n"
        "- A *consumer group* gives each partition to exactly one member at a time.\n"
        "- More partitions mean more parallel consumers, but order only holds per key.\n\n"
        "Here's how a producer sends a keyed event in Python:\n\n"
        "```python\n"
        "await producer.send_and_wait(topic, value, key=session_id.encode())\n"
        "```\n\n"
        "The code block above is shown, not read aloud. "
        "If you change the number of partitions later, keys move to new partitions, so plan the count "
        "before you go to production. "
        "In short, pick a key that groups what must stay ordered, and *let Kafka do the rest*."
    )
    turn.end()
    return Conversation(events, "Long markdown explanation",
                        "Headings, a list, emphasis and a code block streamed as an LLM would (English).")


def _spanish() -> Conversation:
    events: list[ConversationEvent] = []
    turn = _TurnWriter(events, _Clock(random.Random(4)), "es-1", "t1", language="es", voice="ef_dora")
    turn.say(
        "¡Claro que sí! Tu pedido salió de nuestro almacén esta mañana y llegará el jueves. "
        "Te enviaremos un mensaje con el número de seguimiento en cuanto el transportista lo confirme. "
        "¿Necesitas cambiar la dirección de entrega?"
    )
    turn.end()
    return Conversation(events, "Spanish answer", "An order-status answer in Spanish (language es, voice ef_dora).")


def _portuguese() -> Conversation:
    events: list[ConversationEvent] = []
    turn = _TurnWriter(events, _Clock(random.Random(5)), "pt-1", "t1", language="pt", voice="pf_dora")
    turn.say(
        "Olá! A sua assinatura foi renovada com sucesso e o próximo pagamento será no dia quinze. "
        "Você pode cancelar a qualquer momento nas configurações da conta. "
        "Posso ajudar com mais alguma coisa?"
    )
    turn.end()
    return Conversation(events, "Portuguese answer",
                        "A subscription answer in Brazilian Portuguese (language pt, voice pf_dora).")


def _interrupted() -> Conversation:
    events: list[ConversationEvent] = []
    clock = _Clock(random.Random(6))
    first = _TurnWriter(events, clock, "barge-1", "t1")
    first.say(
        "There are three ways to pay your invoice. The quickest is a card payment in the billing page, "
        "which clears immediately. You can also set up a direct debit, which takes about three working days "
        "to activate, and after that every invoice is paid automatically on its due date. The third option "
        "is a bank transfer using the reference printed on the invoice."
    )
    # The user starts talking while the first sentences are being spoken: the edge publishes a
    # cancel for the turn. The agent stops generating (no END_OF_TURN for t1: the turn is over).
    cancel_at = events[len(events) // 2].t_ms + 5.0
    del events[len(events) // 2 + 1 :]
    events.append(ControlLine(cancel_at, "barge-1", "t1", ControlAction.CANCEL, "barge-in", "user"))
    clock.t_ms = cancel_at + 1200.0  # the user's question, then a new answer
    second = _TurnWriter(events, clock, "barge-1", "t2")
    second.say("Sure, I'll send you the invoice by email right now. It should arrive in a minute.")
    second.end()
    return Conversation(
        events, "Interrupted turn (barge-in)",
        "The user interrupts the first answer halfway through (a CANCEL for t1 on the control "
        "topic, the agent stops); the agent then answers the new question in t2.",
    )


BUILDERS = {
    "support.jsonl": _support,
    "rag_slow_retrieval.jsonl": _rag_slow_retrieval,
    "markdown_long.jsonl": _markdown_long,
    "spanish.jsonl": _spanish,
    "portuguese.jsonl": _portuguese,
    "interrupted.jsonl": _interrupted,
}


def build() -> dict[str, Conversation]:
    return {name: make() for name, make in BUILDERS.items()}


def corpus_path(name: str) -> Path:
    """The path of a shipped conversation (`support` or `support.jsonl`)."""
    return CORPUS_DIR / (name if name.endswith(".jsonl") else name + ".jsonl")


def main() -> None:
    CORPUS_DIR.mkdir(exist_ok=True)
    for name, conversation in build().items():
        save(conversation, CORPUS_DIR / name)
        print(f"{name}: {len(conversation.events)} events, {conversation.duration_ms / 1000:.1f} s")


if __name__ == "__main__":
    main()
