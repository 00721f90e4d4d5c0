"""Other libraries' signatures on addnorm's ops, so that code written for them runs unchanged but
for one import: :mod:`addnorm.compat.flash_attn`."""
