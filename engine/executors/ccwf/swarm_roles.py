"""`SwarmRoles`: which peer may send a Swarm client what, from the workflow's config.

Every cell connection is authenticated, so a message's source is the site that sent it (or a
child cell of that site); but a site with a valid key can still lie about its role or its round.
A Swarm client therefore takes a round's model, a result or the final model only from the
sites the server's config names for that role, and only for the round it expects:

- the first round's model from the ``starting_client`` (played again once the server lost it,
  from the aggregation client the server names); a later round's from an aggregation client,
  namely the one that aggregated the previous round when this client took part in it;
- rounds in order: never one it already took, never one outside the job's rounds, and a
  trainer (which takes every round) only the one after its last, save the one after a round it
  gave up (`untake`), from that round's aggregation client: the swarm went on without it;
- a result only from a ``train_clients`` site (the round and once-per-round checks belong to the
  round being gathered, see `RoundGathering.claim`);
- the final model only on a result client, for the last round, once, from the last round's
  aggregation client (a result client that does not train cannot tell which that was: it takes
  the first from any aggregation client);
- nothing from a client the server lost for good (`SwarmRoles.lose`): the swarm went on without it;
- a round dropped (`SwarmRoles.drop_refusal`) only at the word of its aggregation client, once the
  server lost the client that sent the round's model.

The checks answer a reason instead of raising: the controller answers it to the peer as an
error status and the job goes on as if the message never came.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from engine.executors.ccwf.client_side import owner_among
from engine.model import shown_round

#: Header keys of Swarm's peer messages: the round, and the round's aggregation client.
ROUND_KEY, AGGR_KEY = "round", "aggr"
#: Header key of a round's model sent again, to another aggregation client (its first one was
#: lost): the clients it goes without, a list.
REPLAY_KEY = "replay"
#: Times one round may be played again.
MAX_REPLAYS = 3


@dataclasses.dataclass
class SwarmRoles:
    """The roles of a swarm's clients as one client sees them, and the rounds it has taken.

    Thread-safe: the cell's handlers call it from several threads.

    Args:
        site: This client's name.
        start_round: The first round's number.
        end_round: One past the last round's number.
        train_clients: The clients that train every round.
        aggr_clients: The clients that may aggregate a round.
        result_clients: The clients that receive the final model.
        starting_client: The client that sends the first round's model.

    Example:
        >>> roles = SwarmRoles.from_config("site-2", {"start_round": 0, "num_rounds": 2,
        ...     "train_clients": ["site-1", "site-2"], "aggr_clients": ["site-1", "site-2"],
        ...     "result_clients": ["site-1", "site-2"], "starting_client": "site-1"})
        >>> roles.learn_refusal("site-3", {"round": 0, "aggr": "site-1"})
        "site-3 may not send round 1's model: it is not the starting_client (site-1)"
        >>> roles.learn_refusal("site-1", {"round": 0, "aggr": "site-1"}) is None
        True
    """

    site: str
    start_round: int
    end_round: int
    train_clients: Sequence[str]
    aggr_clients: Sequence[str]
    result_clients: Sequence[str]
    starting_client: str
    _last_round: int | None = dataclasses.field(default=None, init=False)
    _last_aggr: str = dataclasses.field(default="", init=False)
    _last_sender: str = dataclasses.field(default="", init=False)  # the site that sent that round's model
    _replays: int = dataclasses.field(default=0, init=False)  # of that round
    #: (round, aggr, sender, replays) of the round taken before the last (`untake` goes back to it)
    _before: tuple[int | None, str, str, int] = dataclasses.field(default=(None, "", "", 0), init=False)
    #: (round, its aggregation client) of the round given up last (`untake`), until a round is taken
    _given_up: tuple[int, str] | None = dataclasses.field(default=None, init=False)
    #: (round, its aggregation client) of the round dropped last (`drop_refusal`), until a round is taken
    _dropped: tuple[int | None, str] = dataclasses.field(default=(None, ""), init=False)
    _final_taken: bool = dataclasses.field(default=False, init=False)
    _lost: frozenset[str] = dataclasses.field(default=frozenset(), init=False)
    #: The aggregation client the server chose to send the first round's model again in place of
    #: the lost starting client (`starts_again_from`)
    _first_round_sender: str = dataclasses.field(default="", init=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False, repr=False)

    @classmethod
    def from_config(cls, site: str, config: Mapping[str, Any]) -> SwarmRoles:
        """The roles in the server's ``swarm_config`` (``start_round``, ``num_rounds``, the client lists).

        Raises:
            KeyError: A key is missing.
            ValueError: A round number is not an integer.
        """
        start_round = int(config["start_round"])
        return cls(
            site=site,
            start_round=start_round,
            end_round=start_round + int(config["num_rounds"]),
            train_clients=list(config["train_clients"]),
            aggr_clients=list(config["aggr_clients"]),
            result_clients=list(config["result_clients"]),
            starting_client=str(config.get("starting_client") or ""),
        )

    @property
    def last_round(self) -> int:
        """The latest round whose model this client took (``start_round - 1`` before the first)."""
        with self._lock:
            return self.start_round - 1 if self._last_round is None else self._last_round

    @property
    def latest(self) -> tuple[int, str]:
        """`last_round` and its aggregation client ("" before the first), read together."""
        with self._lock:
            if self._last_round is None:
                return self.start_round - 1, ""
            return self._last_round, self._last_aggr

    def aggr_of(self, current_round: int) -> str | None:
        """Round ``current_round``'s aggregation client as this client last heard (None: not its latest round)."""
        with self._lock:
            return self._last_aggr if self._last_round == current_round else None

    @property
    def lost(self) -> frozenset[str]:
        """The clients the server lost for good (`lose`)."""
        with self._lock:
            return self._lost

    def lose(self, sites: Sequence[str]) -> list[str]:
        """Note clients the server lost for good; return those of the swarm's roles not known lost before.

        Names without a role in the swarm (a participant may have none) and this client's own
        are left out.

        Raises:
            ValueError: ``sites`` is not a list of names.
        """
        if not isinstance(sites, list) or not all(isinstance(site, str) for site in sites):
            raise ValueError(f"lost clients: expected a list of client names, got {sites!r}"[:300])
        with self._lock:
            new = sorted(set(self.in_swarm(sites)) - {self.site} - self._lost)
            self._lost = self._lost | set(new)
        return new

    def in_swarm(self, sites: Sequence[str]) -> list[str]:
        """``sites`` that have a role in the swarm, the starting client's included (the server's
        participants may include others)."""
        known = self._known
        return [site for site in sites if site in known]

    @property
    def _known(self) -> set[str]:
        """Every client with a role in the swarm."""
        return {*self.train_clients, *self.aggr_clients, *self.result_clients, self.starting_client} - {""}

    def starts_again_from(self, site: Any) -> None:
        """The server's word: ``site``, an aggregation client, sends the first round's model in
        place of the starting client, which the server lost (`_starts_again`).

        Raises:
            ValueError: ``site`` is not one of aggr_clients (the task fails).
        """
        if not isinstance(site, str) or site not in self.aggr_clients:
            raise ValueError(f"the first round's model cannot come again from {site!r}: not one of aggr_clients"[:300])
        with self._lock:
            self._first_round_sender = site

    @property
    def final_taken(self) -> bool:
        """Whether this client took the final model (it is saving it, or saved it)."""
        with self._lock:
            return self._final_taken

    def final_failed(self) -> None:
        """The final model taken could not be saved: one from the expected sender may come again."""
        with self._lock:
            self._final_taken = False

    def lost_owner(self, sender: str) -> str | None:
        """The client the server lost for good that sent from cell ``sender`` (None: not a lost one)."""
        return owner_among(sender, sorted(self.lost))

    def _lost_refusal(self, sender: str, what: str) -> str | None:
        lost = self.lost_owner(sender)
        return f"{lost} may not send {what}: the server lost it, and the swarm went on without it" if lost else None

    @property
    def trains(self) -> bool:
        """Whether this client trains every round."""
        return self.site in self.train_clients

    def learn_refusal(self, sender: str, header: Mapping[str, Any]) -> str | None:
        """Why a round's model from ``sender`` is refused; None when it is taken (and recorded).

        Args:
            sender: The message's authenticated source.
            header: The message's header (``round``, ``aggr``).
        """
        current_round, why = _round_of(header)
        if why:
            return why
        why = self._lost_refusal(sender, f"round {shown_round(current_round)}'s model")
        if why:
            return why
        lost = header.get(REPLAY_KEY, [])
        known = self._known
        if not isinstance(lost, list) or not all(isinstance(site, str) and site in known for site in lost):
            return f"round {shown_round(current_round)}'s model names lost clients that are not in the swarm: {lost!r}"
        aggr = header.get(AGGR_KEY)
        if not isinstance(aggr, str) or aggr not in self.aggr_clients:
            aggrs = ", ".join(self.aggr_clients)
            return (
                f"round {shown_round(current_round)}'s model names {aggr!r} as its aggregation client: "
                f"not in aggr_clients ({aggrs})"
            )
        why = self._rounds_refusal(current_round)
        if why:
            return why
        if not self.trains and aggr != self.site:
            return f"{self.site} neither trains nor aggregates round {shown_round(current_round)}"
        with self._lock:
            if isinstance(header.get(REPLAY_KEY), list) and current_round == self._last_round:
                why = self._replay_refusal(sender, current_round, aggr)
                if why is None:
                    self._replays += 1
                    self._last_aggr = aggr
                    self._last_sender = self._sending_site(sender)
                    self._forget_given_up()
                    # the last round played again: its final model comes again, from the new aggregation client
                    self._final_taken = self._final_taken and current_round != self.end_round - 1
                return why
            if self._last_round is not None and current_round <= self._last_round:
                return (
                    f"round {shown_round(current_round)} is past: "
                    f"{self.site} already took round {shown_round(self._last_round)}"
                )
            if self.trains:
                expected = self.start_round if self._last_round is None else self._last_round + 1
                if current_round != expected and not self._after_given_up(current_round):
                    return (
                        f"round {shown_round(current_round)} is ahead: "
                        f"{self.site} trains round {shown_round(expected)} next"
                    )
            why = self._sender_refusal(sender, current_round, isinstance(header.get(REPLAY_KEY), list))
            if why:
                return why
            self._took(current_round, aggr, self._sending_site(sender))
        return None

    def record_learn(self, current_round: int, aggr: str) -> None:
        """Note a round's model this client gave itself (it started the round, or sent it again)."""
        with self._lock:
            if self._last_round is None or current_round > self._last_round:
                self._took(current_round, aggr, self.site)
            elif current_round == self._last_round:  # played again: its new aggregation client
                self._last_aggr, self._last_sender = aggr, self.site
                self._forget_given_up()

    def _took(self, current_round: int, aggr: str, sender: str) -> None:
        """Record a round's model taken (called with the lock held)."""
        self._before = (self._last_round, self._last_aggr, self._last_sender, self._replays)
        self._last_round, self._last_aggr, self._last_sender, self._replays = current_round, aggr, sender, 0
        self._given_up = None
        self._dropped = (None, "")

    def untake(self, current_round: int, aggr: str | None = None) -> bool:
        """Forget round ``current_round``'s model (aggregated by ``aggr``), taken last but never
        received whole (its sender was lost as it was pulled): this client is back at the round
        before, which may be played again; before the first round, it has taken none.

        When another client received that model whole, the swarm goes on with the round instead,
        without this client: the next round's model is then taken from the round's aggregation
        client (or, after the last round, the final model), and this client has missed one round.

        Returns:
            False (nothing changed) when round ``current_round`` is not the last one taken (or is
            played again meanwhile, with another aggregation client than ``aggr``), or the round
            just before it was not the one taken before it (a client that does not train takes
            only the rounds it aggregates; a round given up already is not there either), or the
            final model was taken meanwhile (the swarm finished without this client's pull).
        """
        with self._lock:
            if self._last_round != current_round or not self._can_go_back(current_round) or self._final_taken:
                return False  # not the last round taken, or the round before it was not taken (or given up)
            if aggr is not None and self._last_aggr != aggr:
                return False  # played again meanwhile: that model comes whole or is given up in turn
            # Its own round given up, it cannot have gone on without this client.
            self._given_up = (current_round, self._last_aggr) if self._last_aggr != self.site else None
            self._back_to_before()
            return True

    def drop_refusal(self, sender: str, current_round: int) -> str | None:
        """Why round ``current_round`` is not dropped at ``sender``'s word; None when it is (or was).

        Its aggregation client (``sender``) could not receive the round's model whole, its sender
        having been lost, and gave the round up, while this client had it: this client drops the
        round as if it never took the model, back at the round before, so that the server sees
        every client there and has that round played again (`untake`, without the next round's
        model that a round given up lets in: that aggregation client makes none). Only the
        round's aggregation client may say so, for this client's last round, once the server lost
        the round model's sender. Said again by it, the drop is answered as done.
        """
        with self._lock:
            if self._said_again(sender, current_round):
                return None  # its word came again (its first answer was lost)
            why = self._drop_blocked(sender, current_round)
            if why:
                return why
            if self._last_sender not in self._lost:
                shown, sender_of = shown_round(current_round), self._last_sender
                return f"round {shown}'s model came from {sender_of}, which the server did not lose"
            self._dropped = (current_round, self._last_aggr)
            self._back_to_before()
            self._given_up = None
        return None

    def drop_blocked(self, sender: str, current_round: int) -> str | None:
        """Why round ``current_round`` can never be dropped at ``sender``'s word, whatever the
        server says of the round model's sender (see `drop_refusal`); None: it may be."""
        with self._lock:
            return None if self._said_again(sender, current_round) else self._drop_blocked(sender, current_round)

    def _said_again(self, sender: str, current_round: int) -> bool:
        """Whether round ``current_round`` was dropped already at ``sender``'s word (lock held)."""
        return self._dropped[0] == current_round and owner_among(sender, [self._dropped[1]]) is not None

    def _sending_site(self, sender: str) -> str:
        """The site whose cell ``sender`` is, among those that send rounds' models (else ``sender``)."""
        return owner_among(sender, [*self.aggr_clients, self.starting_client]) or sender

    def _can_go_back(self, current_round: int) -> bool:
        """Whether this client can be back where it was before it took round ``current_round``, its
        last (lock held): at the round just before, taken before it, or, for the first round, at
        none (the first round's model is the starting checkpoint, which can be sent again)."""
        if current_round == self.start_round:
            return self._before[0] is None
        return self._before[0] == current_round - 1

    def _back_to_before(self) -> None:
        """Make the round taken before the last one the last again (lock held): `untake`, `drop_refusal`."""
        self._last_round, self._last_aggr, self._last_sender, self._replays = self._before
        self._before = (None, "", "", 0)

    def _drop_blocked(self, sender: str, current_round: int) -> str | None:
        """`drop_blocked` (lock held)."""
        shown = shown_round(current_round)
        lost = owner_among(sender, sorted(self._lost))
        if lost:
            return f"{lost} may not send a drop of round {shown}: the server lost it, and the swarm went on without it"
        if self._last_round != current_round:
            return f"{self.site} is not at round {shown}"
        if owner_among(sender, [self._last_aggr]) is None:
            return f"{sender} may not drop round {shown}: it is not its aggregation client ({self._last_aggr})"
        if not self._can_go_back(current_round) or self._final_taken:
            return f"{self.site} cannot go back to the round before round {shown}"
        return None

    def sender_of(self, current_round: int) -> str | None:
        """The client that sent round ``current_round``'s model (None: not this client's last round)."""
        with self._lock:
            return self._last_sender if self._last_round == current_round else None

    def _forget_given_up(self) -> None:
        """The round before the one given up is played again (lock held): the swarm did not go on
        without this client, so what it took as if it had (a final model) does not count."""
        if self._given_up is not None and self._given_up[0] == self.end_round - 1:
            self._final_taken = False
        self._given_up = None

    def _after_given_up(self, current_round: int) -> bool:
        """Whether ``current_round`` follows the round this client gave up last (lock held)."""
        return self._given_up is not None and current_round == self._given_up[0] + 1

    def _replay_refusal(self, sender: str, current_round: int, aggr: str) -> str | None:
        """Why round ``current_round``'s model sent again is refused (called with the lock held).

        Only the site that sent it the first time may (or, for the first round once the server
        lost the starting client, the aggregation client the server named: `_starts_again`),
        naming another aggregation client, and at most `MAX_REPLAYS` times.
        """
        shown = shown_round(current_round)
        if owner_among(sender, [self._last_sender]) is None and not self._starts_again(sender, current_round):
            return f"{sender} may not send round {shown}'s model again: {self._last_sender} sent it"
        if aggr == self._last_aggr:
            return f"round {shown}'s model sent again names its aggregation client {aggr} again"
        if self._replays >= MAX_REPLAYS:
            return f"round {shown} was played again {self._replays} times already"
        return None

    def result_refusal(self, sender: str, header: Mapping[str, Any]) -> str | None:
        """Why a trainer's result from ``sender`` is refused at once; None: see the round's own checks."""
        current_round, why = _round_of(header)
        if why:
            return why
        if owner_among(sender, self.train_clients) is None:
            return f"{sender} is not one of train_clients ({', '.join(self.train_clients)}); its result is refused"
        return self._lost_refusal(sender, "a result") or self._rounds_refusal(current_round)

    def final_refusal(self, sender: str, header: Mapping[str, Any]) -> str | None:
        """Why the final model from ``sender`` is refused; None when it is taken (only once)."""
        if self.site not in self.result_clients:
            return f"{self.site} is not one of result_clients"
        final_round, why = _round_of(header)
        if why:
            return why
        why = self._lost_refusal(sender, "the final model")
        if why:
            return why
        if final_round != self.end_round - 1:
            last = shown_round(self.end_round - 1)
            return f"round {shown_round(final_round)} is not this swarm's last round ({last})"
        with self._lock:
            if self._final_taken:
                return f"{self.site} already took the final model"
            if self._last_round == final_round:
                expected, role = [self._last_aggr], f"the last round's aggregation client ({self._last_aggr})"
            elif self._given_up is not None and self._given_up[0] == final_round:  # it went on without this one
                expected, role = [self._given_up[1]], f"the last round's aggregation client ({self._given_up[1]})"
            elif self.trains:  # a trainer takes every round: the final model cannot come first
                return (
                    f"{self.site} has not taken round {shown_round(final_round)} yet; "
                    "a final model cannot come before it"
                )
            else:
                expected, role = list(self.aggr_clients), f"one of aggr_clients ({', '.join(self.aggr_clients)})"
            if owner_among(sender, expected) is None:
                return f"{sender} may not send the final model: it is not {role}"
            self._final_taken = True
        return None

    def _rounds_refusal(self, current_round: int) -> str | None:
        if not self.start_round <= current_round < self.end_round:
            first, last = shown_round(self.start_round), shown_round(self.end_round - 1)
            return f"round {shown_round(current_round)} is not a round of this swarm ({first} to {last})"
        return None

    def _starts_again(self, sender: str, current_round: int) -> bool:
        """Whether ``sender`` may send the first round's model again in place of the starting client
        (lock held): the server lost the starting client, and told this client that ``sender``
        sends the starting model again (`starts_again_from`, `ModelPersistor.load_starting_model`)."""
        return (
            current_round == self.start_round
            and self.starting_client in self._lost
            and bool(self._first_round_sender)
            and owner_among(sender, [self._first_round_sender]) is not None
            and owner_among(sender, sorted(self._lost)) is None
        )

    def _sender_refusal(self, sender: str, current_round: int, replay: bool = False) -> str | None:
        """Whether ``sender`` is who sends round ``current_round``'s model (called with the lock held);
        ``replay``: the model says it is sent again."""
        if current_round == self.start_round:
            if replay and self._starts_again(sender, current_round):
                return None
            expected, role = [self.starting_client], f"the starting_client ({self.starting_client})"
        elif self._after_given_up(current_round):
            assert self._given_up is not None
            given_up, aggr = self._given_up
            expected, role = [aggr], f"round {shown_round(given_up)}'s aggregation client ({aggr})"
        elif self._last_round == current_round - 1:
            role = f"round {shown_round(self._last_round)}'s aggregation client ({self._last_aggr})"
            expected = [self._last_aggr]
        else:
            expected, role = list(self.aggr_clients), f"one of aggr_clients ({', '.join(self.aggr_clients)})"
        if owner_among(sender, expected) is None:
            return f"{sender} may not send round {shown_round(current_round)}'s model: it is not {role}"
        return None


def _round_of(header: Mapping[str, Any]) -> tuple[int, str]:
    """The header's round number, or a reason when it has none (an int, never a bool)."""
    value = header.get(ROUND_KEY)
    if type(value) is not int:
        return -1, f"the message names no round number (round={value!r})"
    return value, ""
