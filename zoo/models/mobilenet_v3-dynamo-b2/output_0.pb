
Boutput_0JPbc>´Aq5€4è¬´h 5Ônh3¦rÝ³òØL4YÛ4K7ã²‚Hd4J>ý±”4±J¾³éf7³`È‘4h´§2’·±2lË3Õ L1