"""kvpolicy-research: research parts of kvpolicy as a plugin (formats, file codecs, transforms)."""
