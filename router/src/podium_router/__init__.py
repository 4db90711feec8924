"""``podium router``: one OpenAI-compatible endpoint over many replicas; ``podium fleet``: replicas on Ray.

The router talks to replicas over HTTP only (it imports neither ``podium`` nor ``podium_server``):
``policy`` holds the routing rule, ``replica`` what the router knows of each replica, ``monitor``
how it learns it, ``proxy`` how a request is forwarded (retries, streams passed through).
"""

__version__ = "0.1.0"
