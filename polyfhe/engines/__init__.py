"""One folder per engine (seal/, lattigo/, concrete/). Each is reached through its record in
:mod:`polyfhe.program.engines`; no engine folder imports another."""
