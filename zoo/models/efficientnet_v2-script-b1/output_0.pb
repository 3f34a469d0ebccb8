
Boutput_0J(zq7k»‡vΕΊsL;UDΥ»%θDΉΪβή»X €;Eηq»Ό