"""Message authentication (HMAC) and the peer allowlist."""

from __future__ import annotations

import ipaddress

import pytest

from moriio_native.control.security import (
    ENV_AUTH_SECRET,
    AuthenticationError,
    ControlSecurity,
    FreshStamps,
    MessageAuth,
    PeerAllowlist,
    PeerNotAllowedError,
    RegistrationVerifier,
    listener_handshake_ms,
)
from moriio_native.errors import InvalidArgumentError

SECRET = "0123456789abcdef-shared"


def test_sealed_payload_opens_with_the_same_secret():
    auth = MessageAuth(SECRET)
    frames = auth.seal(b"payload")
    assert frames[0] == b"payload" and len(frames) == 2
    assert auth.open(frames) == b"payload"


def test_forged_tag_is_refused():
    auth = MessageAuth(SECRET)
    payload, tag = auth.seal(b"payload")
    forged = bytes([tag[0] ^ 1]) + tag[1:]
    with pytest.raises(AuthenticationError, match="does not match"):
        auth.open([payload, forged])
    # A tag made with another secret, and a tampered payload with the original tag.
    with pytest.raises(AuthenticationError):
        auth.open(MessageAuth("another-secret-of-16+").seal(b"payload"))
    with pytest.raises(AuthenticationError):
        auth.open([b"payloaD", tag])


def test_an_answer_tag_matches_only_its_answer_under_its_secret():
    """Prefill answers are tagged in their own domain: a control message's tag of the same
    bytes is not an answer's tag, nor is another secret's, another answer's or none."""
    auth = MessageAuth(SECRET)
    tag = auth.tag_answer(b"answer")
    assert len(tag) == 64 and tag == tag.lower()
    assert auth.answer_tag_matches(b"answer", tag)
    assert not auth.answer_tag_matches(b"answeR", tag)
    assert not auth.answer_tag_matches(b"answer", None)
    assert not auth.answer_tag_matches(
        b"answer", MessageAuth("another-secret-of-16+").tag_answer(b"answer")
    )
    assert not auth.answer_tag_matches(b"answer", auth.seal(b"answer")[1].hex())


def test_missing_tag_is_refused_when_a_secret_is_set():
    with pytest.raises(AuthenticationError, match="2 frames"):
        MessageAuth(SECRET).open([b"payload"])


def test_tag_without_local_secret_names_the_misconfiguration():
    tagged = MessageAuth(SECRET).seal(b"payload")
    with pytest.raises(AuthenticationError, match="no auth_secret is configured"):
        MessageAuth(None).open(tagged)
    assert MessageAuth(None).open([b"payload"]) == b"payload"


def test_short_or_bad_secrets_are_rejected():
    with pytest.raises(InvalidArgumentError, match="at least 16"):
        MessageAuth("short")
    with pytest.raises(InvalidArgumentError, match="at least 16"):
        MessageAuth.from_config({"auth_secret": ""})
    with pytest.raises(InvalidArgumentError, match="str or bytes"):
        MessageAuth(1234)  # type: ignore[arg-type]


def test_secret_comes_from_config_then_environment(monkeypatch):
    monkeypatch.delenv(ENV_AUTH_SECRET, raising=False)
    assert not MessageAuth.from_config({}).enabled
    monkeypatch.setenv(ENV_AUTH_SECRET, "environment-secret-1234")
    from_env = MessageAuth.from_config({})
    assert from_env.open(MessageAuth("environment-secret-1234").seal(b"x")) == b"x"
    from_config = MessageAuth.from_config({"auth_secret": SECRET})
    with pytest.raises(AuthenticationError):
        from_config.open(from_env.seal(b"x"))
    monkeypatch.setenv(ENV_AUTH_SECRET, "")
    assert not MessageAuth.from_config(None).enabled


def test_allowlist_cidrs_names_and_nothing_else():
    allow = PeerAllowlist(["10.0.0.0/16", "fd00::/8", "192.168.1.7", "prefill-0.svc.local"])
    for host in (
        "10.0.3.4",
        "fd00::1",
        "[fd00::2]",
        "192.168.1.7",
        "Prefill-0.svc.local",
        "::ffff:10.0.0.9",
    ):
        assert allow.check(host), host
    for host in ("10.1.0.1", "192.168.1.8", "127.0.0.1", "::1", "prefill-1.svc.local", "evil.com"):
        assert not allow.check(host), host


@pytest.mark.parametrize("garbage", ["", " ", "a b", "1.2.3.4:80", "host_x", None, 5, "x" * 300])
def test_allowlist_check_refuses_garbage_without_raising(garbage):
    assert not PeerAllowlist(["0.0.0.0/0"]).check(garbage)


def test_empty_allowlist_allows_only_learned_hosts():
    allow = PeerAllowlist()
    assert not allow.check("10.0.0.5")
    assert allow.learn("10.0.0.5")
    assert allow.check("10.0.0.5")
    assert not allow.check("10.0.0.6")
    assert not allow.learn("some-host-name")  # only real source addresses are learned


def test_learned_hosts_are_bounded():
    allow = PeerAllowlist(max_learned=2)
    for host in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        allow.learn(host)
    assert not allow.check("10.0.0.1")
    assert allow.check("10.0.0.2") and allow.check("10.0.0.3")


def test_require_raises_and_names_the_peer():
    allow = PeerAllowlist(["10.0.0.0/8"])
    assert allow.require("10.9.8.7", purpose="test") == "10.9.8.7"
    with pytest.raises(PeerNotAllowedError, match=r"'203\.0\.113\.5'.*release to 203"):
        allow.require("203.0.113.5", purpose="release to 203.0.113.5:61005")


def test_star_allows_everything():
    allow = PeerAllowlist(["*"])
    assert allow.check("203.0.113.5") and allow.check("2001:db8::1")


@pytest.mark.parametrize("entry", ["10.0.0.0/33", "not a host", "", 7])
def test_bad_allowlist_entries_are_named(entry):
    with pytest.raises(InvalidArgumentError, match="allowed_peers"):
        PeerAllowlist([entry])


def test_control_security_from_config(monkeypatch):
    monkeypatch.delenv(ENV_AUTH_SECRET, raising=False)
    sec = ControlSecurity.from_config(
        {"allowed_peers": "10.0.0.0/8, 127.0.0.1", "auth_secret": SECRET}
    )
    assert sec.auth.enabled
    assert sec.allowlist.check("127.0.0.1") and sec.allowlist.check("10.2.3.4")
    with pytest.raises(InvalidArgumentError, match="allowed_peers"):
        ControlSecurity.from_config({"allowed_peers": 5})


@pytest.mark.parametrize(
    ("value", "ms"), [(2, 2000), ("0.5", 500), (0.05, 50), ("30", 30000), (1.2345, 1234)]
)
def test_listener_handshake_timeout_becomes_milliseconds(value: object, ms: int) -> None:
    assert listener_handshake_ms(value) == ms
    assert (
        ControlSecurity.from_config({"listener_handshake_timeout": value}).listener_handshake_ms
        == ms
    )


@pytest.mark.parametrize(
    "value", [0, 0.01, 30.5, -1, "nan", "inf", "soon", True, None, [2], 10**400]
)
def test_a_bad_listener_handshake_timeout_is_refused_naming_the_key(value: object) -> None:
    """ZMQ reads 0 as no limit at all, and a bool or NaN must not pass as a number; an int
    beyond any float raised OverflowError instead (found by a review)."""
    with pytest.raises(InvalidArgumentError, match="listener_handshake_timeout"):
        listener_handshake_ms(value)


# ---- signed proxy registrations ---------------------------------------------------------------


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_signed_registration_is_accepted_once():
    auth = MessageAuth(SECRET)
    verifier = RegistrationVerifier(auth, window_s=60, clock=Clock(1000.0))
    frames = auth.seal_registration(b"ping", now=1000.0)
    assert len(frames) == 3
    assert verifier.open(frames) == b"ping"
    with pytest.raises(AuthenticationError, match="replayed"):
        verifier.open(frames)
    # A new ping of the same payload gets a new stamp and is accepted.
    assert verifier.open(auth.seal_registration(b"ping", now=1001.0)) == b"ping"


def test_stale_or_future_registration_is_refused():
    auth = MessageAuth(SECRET)
    verifier = RegistrationVerifier(auth, window_s=60, clock=Clock(1000.0))
    with pytest.raises(AuthenticationError, match="old"):
        verifier.open(auth.seal_registration(b"ping", now=900.0))
    with pytest.raises(AuthenticationError, match="old"):
        verifier.open(auth.seal_registration(b"ping", now=1100.0))


def test_replay_stays_refused_until_the_stamp_is_stale():
    auth = MessageAuth(SECRET)
    clock = Clock(1000.0)
    verifier = RegistrationVerifier(auth, window_s=60, clock=clock)
    frames = auth.seal_registration(b"ping", now=1050.0)  # 50 s ahead: within the window
    assert verifier.open(frames) == b"ping"
    for now in (1061.0, 1100.0, 1110.0):  # past the receipt's window, the stamp's not yet
        clock.now = now
        with pytest.raises(AuthenticationError, match="replayed"):
            verifier.open(frames)
    clock.now = 1111.0
    with pytest.raises(AuthenticationError, match="old"):
        verifier.open(frames)


def test_forged_and_cross_message_registrations_are_refused():
    auth = MessageAuth(SECRET)
    verifier = RegistrationVerifier(auth, clock=Clock(1000.0))
    payload, stamp, tag = auth.seal_registration(b"ping-a", now=1000.0)
    with pytest.raises(AuthenticationError, match="does not match"):
        verifier.open([payload, stamp, bytes([tag[0] ^ 1]) + tag[1:]])
    # The tag of one registration does not cover another payload or another stamp.
    with pytest.raises(AuthenticationError, match="does not match"):
        verifier.open([b"ping-b", stamp, tag])
    other_stamp = auth.seal_registration(b"ping-a", now=1000.0)[1]
    with pytest.raises(AuthenticationError, match="does not match"):
        verifier.open([payload, other_stamp, tag])
    # A control message's tag (another domain) is no registration tag.
    control_payload, control_tag = auth.seal(stamp + b"ping-a")
    with pytest.raises(AuthenticationError, match="does not match"):
        verifier.open([b"ping-a", stamp, control_tag])
    assert control_payload == stamp + b"ping-a"
    # Another secret's signature.
    other = MessageAuth("another secret, 32 bytes long!!!")
    with pytest.raises(AuthenticationError, match="does not match"):
        verifier.open(other.seal_registration(b"ping-a", now=1000.0))


def test_unsigned_registration_is_refused_when_a_secret_is_set():
    verifier = RegistrationVerifier(MessageAuth(SECRET), clock=Clock(1000.0))
    with pytest.raises(AuthenticationError, match="not signed"):
        verifier.open([b"ping"])
    open_verifier = RegistrationVerifier(MessageAuth(None))
    assert open_verifier.open([b"ping"]) == b"ping"
    with pytest.raises(AuthenticationError, match="no auth_secret"):
        open_verifier.open(MessageAuth(SECRET).seal_registration(b"ping"))


def test_verifier_refuses_rather_than_forgets_when_full():
    auth = MessageAuth(SECRET)
    verifier = RegistrationVerifier(auth, max_stamps=2, clock=Clock(1000.0))
    for _ in range(2):
        verifier.open(auth.seal_registration(b"ping", now=1000.0))
    with pytest.raises(AuthenticationError, match="more than 2"):
        verifier.open(auth.seal_registration(b"ping", now=1000.0))


def test_accepting_only_allowed_peers_filters_on_their_networks_in_the_listeners_family():
    allow = PeerAllowlist.from_config(
        {
            "allowed_peers": "10.0.0.0/16, 127.0.0.1, 2001:db8::/64",
            "accept_only_allowed_peers": True,
        }
    )
    assert allow.accept_filters(ipv6=False) == ("10.0.0.0/16", "127.0.0.1/32")
    # An IPv6 listener sees IPv4 peers as IPv4-mapped addresses: the prefix covers all 128 bits.
    assert allow.accept_filters(ipv6=True) == (
        "::ffff:10.0.0.0/112",
        "::ffff:127.0.0.1/128",
        "2001:db8::/64",
    )
    assert (
        PeerAllowlist.from_config({"allowed_peers": "10.0.0.0/16"}).accept_filters(ipv6=False) == ()
    )
    # An IPv6 network is given without the IPv4-mapped range: an IPv4 peer gets in through its
    # IPv4 networks only, as check() has it.
    any_ipv6 = PeerAllowlist(["10.0.0.0/8", "::/0"], accept_only=True)
    filters = [ipaddress.ip_network(f) for f in any_ipv6.accept_filters(ipv6=True)]
    for address, admitted in (("::ffff:10.1.2.3", True), ("::ffff:127.0.0.1", False)):
        assert any(ipaddress.ip_address(address) in f for f in filters) == admitted
        assert any_ipv6.check(address) == admitted
    assert all(any(ipaddress.ip_address(a) in f for f in filters) for a in ("::1", "2001:db8::7"))
    # An IPv4-mapped network (how an IPv6 listener shows IPv4 peers) stands for its IPv4 one.
    only_mapped = PeerAllowlist(["::ffff:10.0.0.0/104"], accept_only=True)
    assert only_mapped.accept_filters(ipv6=True) == ("::ffff:10.0.0.0/104",)
    assert only_mapped.accept_filters(ipv6=False) == ("10.0.0.0/8",)
    only_ipv6 = PeerAllowlist(["2001:db8::/64"], accept_only=True)
    assert only_ipv6.accept_filters(ipv6=True) == ("2001:db8::/64",)
    with pytest.raises(InvalidArgumentError, match=r"accept_only_allowed_peers.*only IPv6"):
        only_ipv6.accept_filters(ipv6=False)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"accept_only_allowed_peers": True}, "without it no peer could connect"),
        ({"allowed_peers": [], "accept_only_allowed_peers": True}, "without it no peer"),
        ({"allowed_peers": ["10.0.0.0/8", "node1"], "accept_only_allowed_peers": True}, "'node1'"),
        ({"allowed_peers": ["*"], "accept_only_allowed_peers": True}, "accepts everyone"),
        ({"allowed_peers": ["10.0.0.0/8"], "accept_only_allowed_peers": "yes"}, "'yes'"),
    ],
)
def test_accepting_only_allowed_peers_refuses_what_it_cannot_filter_on(config, named):
    with pytest.raises(InvalidArgumentError, match=named) as err:
        ControlSecurity.from_config(config)
    assert "accept_only_allowed_peers" in str(err.value)


def test_fresh_stamps_refuse_only_when_that_many_unexpired_stamps_are_held():
    """A stamp sent ahead of this clock (within the window: accepted) expires last; arriving
    first, it sat at the head of the memory, which forgot expired stamps from its head only,
    so stamps behind it stayed counted after they expired and fresh ones were refused while
    one unexpired stamp of 2 was held. (Found by a review, 2026-12-07.)"""
    now = [1000.0]
    stamps = FreshStamps("test", window_s=1.0, max_stamps=2, clock=lambda: now[0])
    stamps.accept(1_000_900, b"ahead")  # sent 0.9 s ahead of this clock: kept until 1001.9
    stamps.accept(1_000_000, b"first")  # kept until 1001.0
    now[0] = 1001.5
    stamps.accept(1_001_500, b"fresh")
    with pytest.raises(AuthenticationError, match="more than 2"):
        stamps.accept(1_001_500, b"one too many")  # "ahead" and "fresh" unexpired
    with pytest.raises(AuthenticationError, match="replayed"):
        stamps.accept(1_000_900, b"ahead")


def test_an_ipv4_mapped_allowlist_entry_stands_for_its_ipv4_address():
    """ "::ffff:10.0.0.5" (how an IPv6 listener shows the IPv4 peer 10.0.0.5) was accepted and
    allowed nothing: check() judges such hosts by the IPv4 networks. (Found by a review,
    2026-12-07.)"""
    allowlist = PeerAllowlist(["::ffff:10.0.0.5", "::ffff:192.168.0.0/120"])
    for host in ("10.0.0.5", "::ffff:10.0.0.5", "192.168.0.9", "::ffff:192.168.0.9"):
        assert allowlist.check(host), host
    assert not allowlist.check("10.0.0.6") and not allowlist.check("192.168.1.9")


def test_star_allows_host_names_too():
    """ "*" allows everything, as documented: host names too, not only every address.
    (Found by a review, 2026-12-07.)"""
    allowlist = PeerAllowlist(["*"])
    assert allowlist.check("10.0.0.1") and allowlist.check("::1")
    assert allowlist.check("prefill-0.example.com")
    assert not PeerAllowlist(["10.0.0.0/8"]).check("prefill-0.example.com")
