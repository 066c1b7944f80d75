"""``python -m kvpolicy_lmcache <lmcache arguments>``: LMCache's command line with the codecs registered."""

from kvpolicy_lmcache.launcher import main

main()
