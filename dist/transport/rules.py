"""What a transport asks before it files a message, when it is made without a job's rules.

The transport knows nothing of schemes, roles or the book: the job's checks (dist/coord/checks.py,
`WireRules`) are handed to it by whoever makes it, and a bare transport (a tool, a unit test)
gets `DecodingOnly`, which accepts every message that decodes.
"""


class DecodingOnly:
    """The rules of a transport outside a job: every decoded message may be filed."""

    roles = None

    def __init__(self):
        self.book = None

    def set_book(self, book):
        self.book = book

    def check(self, msg):
        return None

    def check_specs(self, mtype, sender, key, specs):
        return None

    def ring_label(self, key):
        return f"key {key}"
