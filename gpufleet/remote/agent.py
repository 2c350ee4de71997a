"""The agent exactly as a host runs it, as one module: the joined pieces, executed here.

The pieces (gpufleet/remote/parse.py, jobs.py, procfs.py, snapshot.py, clean.py, main.py)
are modules with namespaces of their own; on a host they share ONE namespace (see
``gpufleet.remote.agent_source``). This module is that namespace, so a test that patches a
name here and then calls a function that uses it sees what a host would, and
``python3 -m gpufleet.remote.agent < request.json`` runs the very payload a host gets (an
empty stdin means a snapshot). Not sent itself; nothing on the controller imports it.
"""
from gpufleet.remote import agent_source

_DOC = __doc__
exec(compile(agent_source(), "gpufleet-agent", "exec"), globals())  # noqa: S102 - our own source
__doc__ = _DOC
