"""Interop with third-party pair-trunk implementations (their modules -> CP twins).

``twinshard.pair.interop.boltz``: build the CP twin of a ``boltz`` (Boltz-2) module and load its
``state_dict`` unchanged. Importing this package never imports the third-party library.
"""
