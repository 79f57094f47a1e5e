"""The engine-neutral program format: manifest (typed steps), parameters, wire containers, key folders, and the
registry that names each engine package."""
